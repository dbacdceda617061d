"""Sync and asyncio clients over the same request builders and reply parsers.

Both hide the stubs, return the typed objects of ``ferrum_rpc.types`` and turn
``grpc.RpcError`` into the error table's exceptions with one helper
(``ferrum_rpc.errors.from_rpc_error``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Sequence, Union

import grpc

from ferrum_rpc import convert, tensor_codec
from ferrum_rpc.errors import ExecutorError, from_status_proto, from_rpc_error
from ferrum_rpc.types import (
    Capabilities,
    DecodeInput,
    DecodeOutput,
    ExecutorStatus,
    KvCacheHandle,
    LogitsKind,
    LogitsPolicy,
    ModelInfo,
    HiddenStatesRequest,
    PrefillOutput,
    SpeculativeOutput,
    SpeculativeSampling,
    VerifyOutput,
)
from ferrum_rpc.client.shm import AsyncSharedMemoryRegion, SharedMemoryRegion
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

DEFAULT_MAX_MESSAGE_BYTES = 512 << 20  # above the server's default 256 MiB reply limit
DecodeItem = Union[DecodeInput, tuple[int, KvCacheHandle]]
# The caller's deadline as wall-clock time (ns since the Unix epoch), sent beside gRPC's
# relative timeout: gRPC sends "N seconds from now" and the server counts from when it
# reads the headers, so a call that sat in a frozen server's socket past its deadline
# would run with a fresh one on resume.  Optional; relies on synchronized clocks.
DEADLINE_HEADER = "ferrum-deadline-unix-ns"


@dataclass(frozen=True)
class Keepalive:
    """HTTP/2 keepalive pings on a client's channels, so that a server that stops
    answering (frozen, partitioned, gone without a TCP reset) is noticed: a ping not
    acknowledged within ``timeout_s`` closes the connection and every call on it ends
    UNAVAILABLE (a replica set then moves the sequences, as for a dead server).

    Attributes:
        time_s: a ping after this long without one (the connection busy or idle).
        timeout_s: how long an unanswered ping waits before the connection is closed.
        without_calls: ping idle connections too (a dead replica is known before a
            call is sent to it).

    Detection takes ``time_s`` to ``time_s + timeout_s`` (2-4 s with the defaults).  The
    ferrum-rpc server accepts a ping every second (``server/app.py``,
    ``KEEPALIVE_SERVER_OPTIONS``); pinging it more often than that gets the connection
    closed with GOAWAY "too_many_pings", so keep ``time_s`` at 1 s or more (and within
    what any proxy in between accepts).
    """

    time_s: float = 2.0
    timeout_s: float = 2.0
    without_calls: bool = True

    def options(self) -> list[tuple[str, int]]:
        return [
            ("grpc.keepalive_time_ms", int(self.time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.timeout_s * 1000)),
            # gRPC 1.85 closes a connection on an unanswered ping only after this (default:
            # a minute), whatever keepalive_timeout_ms says: measured, a frozen server was
            # noticed after 4 s with it and not in 15 s without.
            ("grpc.http2.ping_timeout_ms", int(self.timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", int(self.without_calls)),
            # gRPC stops pinging after 2 pings with no data sent (its default), which is
            # exactly when a call waits on a hung server: no limit.
            ("grpc.http2.max_pings_without_data", 0),
        ]


DEFAULT_KEEPALIVE = Keepalive()


def _options(max_message_bytes: int, keepalive: Keepalive | None = None) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *(keepalive.options() if keepalive is not None else ()),
    ]


def _deadline_metadata(timeout: float | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata of a call with ``timeout``: its absolute deadline (see DEADLINE_HEADER)."""
    if timeout is None:
        return None
    return ((DEADLINE_HEADER, str(time.time_ns() + int(timeout * 1e9))),)


@dataclass(frozen=True)
class ClientTls:
    """TLS for a client channel (PEM file paths).

    Attributes:
        ca: CA bundle the server's certificate must chain to ("" = the system roots).
        cert, key: this client's certificate chain and key, for servers that require mTLS.
        server_name: the name to verify in the server's certificate, when the
            target address is not it (an IP, a tunnel).
    """

    ca: str = ""
    cert: str = ""
    key: str = ""
    server_name: str = ""


def _channel(target: str, options: list, tls: ClientTls | None, token: str | None, aio: bool):
    """A channel to ``target``: plaintext, TLS or mTLS, with a bearer token on every call.

    A token travels only over TLS, or over plaintext to a loopback address
    (gRPC's local credentials check that the peer is local)."""
    grpc_mod = grpc.aio if aio else grpc
    if tls is None and token is None:
        return grpc_mod.insecure_channel(target, options=options)
    if tls is not None:
        read = lambda path: Path(path).read_bytes() if path else None  # noqa: E731
        if bool(tls.cert) != bool(tls.key):
            raise ValueError("a client certificate needs its key (and the key its certificate)")
        creds = grpc.ssl_channel_credentials(read(tls.ca), read(tls.key), read(tls.cert))
        if tls.server_name:
            options = [*options, ("grpc.ssl_target_name_override", tls.server_name)]
    else:
        creds = grpc.local_channel_credentials(grpc.LocalConnectionType.LOCAL_TCP)
    if token is not None:
        creds = grpc.composite_channel_credentials(creds, grpc.access_token_call_credentials(token))
    return grpc_mod.secure_channel(target, creds, options=options)


def _single(target: str | Sequence[str]) -> str:
    """The one address of a single-target client (a list of one, or a plain string)."""
    if isinstance(target, str):
        return target
    (only,) = target
    return only


def _replica_class(cls: type, target: str | Sequence[str], aio: bool) -> type:
    """The class a client constructor builds: ``cls`` itself, or the replica-set
    client when ``target`` names several servers (only for the public classes, so
    subclasses and the replica set's own per-replica clients are left alone)."""
    if cls not in (ExecutorClient, AsyncExecutorClient):
        return cls
    from ferrum_rpc.client import replicas

    if len(replicas.resolve_targets(target)) < 2:
        return cls
    return replicas.AsyncReplicaSetClient if aio else replicas.ReplicaSetClient


class _Codec:
    """Request builders and reply parsers shared by both clients."""

    model: str
    _regions: dict  # shared-memory regions this client registered, by name

    def _read_region(self, location: pb.SharedMemoryLocation) -> memoryview:
        region = self._regions.get(location.region)
        if region is None:
            raise ExecutorError(f"logits were written to shared-memory region {location.region!r}, "
                                "which this client did not register")
        return region.view(location)

    def _prefill_req(self, token_ids, kv_cache, logits, hidden_states=None) -> pb.PrefillRequest:
        req = pb.PrefillRequest(model=self.model, token_ids=token_ids, logits=convert.policy_to_proto(logits))
        if kv_cache is not None:
            req.kv_cache.CopyFrom(convert.handle_to_proto(kv_cache))
        if hidden_states is not None:
            req.hidden_states.CopyFrom(convert.hidden_request_to_proto(hidden_states))
        return req

    def _decode_req(self, token_id, kv_cache, logits) -> pb.DecodeRequest:
        return pb.DecodeRequest(model=self.model, token_id=token_id, kv_cache=convert.handle_to_proto(kv_cache),
                                logits=convert.policy_to_proto(logits))

    def _batch_req(self, items: Iterable[DecodeItem], logits) -> pb.BatchDecodeRequest:
        # Small rows (top-k, argmax, rows in shared memory) come back in one message
        # (a stream message per sequence costs ~0.35 ms); full rows stay one message each.
        small = logits.kind is not LogitsKind.FULL or logits.shared_memory is not None
        req = pb.BatchDecodeRequest(model=self.model, logits=convert.policy_to_proto(logits), single_reply=small)
        for item in items:
            token_id, handle = (item.token_id, item.kv_cache) if isinstance(item, DecodeInput) else item
            req.items.add(token_id=token_id, kv_cache=convert.handle_to_proto(handle))
        return req

    def _verify_req(self, token_ids, kv_cache, logits) -> pb.ForwardVerifyRequest:
        return pb.ForwardVerifyRequest(model=self.model, token_ids=token_ids,
                                       kv_cache=convert.handle_to_proto(kv_cache),
                                       logits=convert.policy_to_proto(logits))

    def _session_req(self, step_id: int, items: Iterable[DecodeItem], logits) -> pb.DecodeSessionRequest:
        batch = self._batch_req(items, logits)
        return pb.DecodeSessionRequest(step_id=step_id, model=batch.model, items=batch.items, logits=batch.logits,
                                       single_reply=batch.single_reply)

    def _speculative_req(self, token_id, draft, kv_cache, logits, sampling=None) -> pb.SpeculativeDecodeRequest:
        req = pb.SpeculativeDecodeRequest(model=self.model, token_id=token_id, draft_token_ids=list(draft),
                                          kv_cache=convert.handle_to_proto(kv_cache),
                                          logits=convert.policy_to_proto(logits))
        if sampling is not None:
            req.sampling.CopyFrom(pb.SpeculativeSampling(temperature=sampling.temperature, top_k=sampling.top_k,
                                                         top_p=sampling.top_p, seed=sampling.seed))
        return req

    def _batch_prefill_req(self, prompts, logits) -> pb.BatchPrefillRequest:
        req = pb.BatchPrefillRequest(model=self.model, logits=convert.policy_to_proto(logits))
        for prompt in prompts:
            continues = isinstance(prompt, tuple) and len(prompt) == 2 and isinstance(prompt[1], KvCacheHandle)
            token_ids, handle = prompt if continues else (prompt, None)
            item = req.items.add(token_ids=token_ids)
            if handle is not None:
                item.kv_cache.CopyFrom(convert.handle_to_proto(handle))
        return req

    def _speculative_output(self, reply: pb.SpeculativeDecodeResponse) -> SpeculativeOutput:
        out = self._output(DecodeOutput, reply)
        return SpeculativeOutput(tuple(reply.accepted_token_ids), reply.next_token_id, out.logits, out.kv_cache,
                                 out.timing)

    def _batch_prefill_outputs(self, replies) -> list[PrefillOutput]:
        return [self._prefill_output(r) for r in sorted(replies, key=lambda r: r.index)]

    def _release_req(self, cache) -> pb.ReleaseCacheRequest:
        if isinstance(cache, KvCacheHandle):
            return pb.ReleaseCacheRequest(cache_id=cache.cache_id, model=cache.model)
        return pb.ReleaseCacheRequest(cache_id=cache, model=self.model)

    def _output(self, cls, reply):
        return cls(convert.logits_from_proto(reply.logits, self._read_region),
                   convert.handle_from_proto(reply.kv_cache), convert.timing_from_proto(reply.timing))

    def _prefill_output(self, reply: pb.PrefillResponse) -> PrefillOutput:
        out = self._output(PrefillOutput, reply)
        hidden = tuple(tensor_codec.to_numpy(t) for t in getattr(reply, "hidden_states", ()))
        weights = tuple(tensor_codec.to_numpy(t) for t in getattr(reply, "attention_weights", ()))
        return replace(out, cached_tokens=reply.cached_tokens, hidden_states=hidden, attention_weights=weights)

    def _batch_outputs(self, replies: Sequence[pb.BatchDecodeResponse]) -> list[DecodeOutput]:
        replies = [r for reply in replies for r in (reply.results or [reply])]  # single_reply: one message
        ordered = sorted(replies, key=lambda r: r.index)
        return [self._output(DecodeOutput, r) for r in ordered]


class ExecutorClient(_Codec):
    """Blocking client.

    Args:
        target: "host:port" of a ferrum-rpc server, or several replicas: a list of
            targets, or gRPC's multi-address forms ("ipv4:10.0.0.1:5001,10.0.0.2:5001",
            "ipv6:[::1]:5001,[::1]:5002", "dns:///host:port" resolving to several
            addresses).  Several replicas give a
            :class:`~ferrum_rpc.client.replicas.ReplicaSetClient` (placement by load,
            handle affinity, failover by history replay); one target behaves as always.
        model: the hosted model to address; "" means the server's default.
        timeout: per-call deadline in seconds (None: no deadline).
        max_message_bytes: largest reply accepted.
        tls: connect with TLS (and a client certificate for mTLS); None: plaintext.
        token: bearer token sent on every call (servers run with ``--auth-tokens``);
            only over TLS or to a loopback address.
        failover: several replicas only: move a sequence to another replica by replaying
            its history when its owner dies, restarts or drains (False: the error
            reaches the caller).
        replica_policy: several replicas only: placement and failover bounds
            (:class:`~ferrum_rpc.client.replicas.ReplicaPolicy`; None: the defaults).
        channel_options: extra gRPC channel arguments.
        keepalive: HTTP/2 keepalive pings (:class:`Keepalive`: every 2 s, 2 s to answer),
            so a server that stops answering ends the calls on it with UNAVAILABLE
            within a few seconds; None: gRPC's defaults (no pings).

    With a ``timeout``, each call also carries its absolute deadline (metadata
    ``ferrum-deadline-unix-ns``), so a server that reads the call late (it was frozen
    or stalled) refuses it instead of running it after the caller gave up.
    """

    def __new__(cls, target: str | Sequence[str], *args, **kwargs):
        return super().__new__(_replica_class(cls, target, aio=False))

    def __init__(self, target: str | Sequence[str], *, model: str = "", timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ClientTls | None = None,
                 token: str | None = None, failover: bool = True, replica_policy=None,
                 channel_options: Sequence[tuple[str, object]] = (),
                 keepalive: Keepalive | None = DEFAULT_KEEPALIVE):
        self.model, self.timeout = model, timeout
        options = _options(max_message_bytes, keepalive) + list(channel_options)
        self._channel = _channel(_single(target), options, tls, token, aio=False)
        self._stub = pb_grpc.ModelExecutorStub(self._channel)
        self._regions: dict[str, SharedMemoryRegion] = {}

    def _status_probe(self, timeout: float) -> ExecutorStatus:
        """GetStatus with its own deadline (replica sets probe with a short one)."""
        try:
            reply = self._stub.GetStatus(pb.GetStatusRequest(model=self.model), timeout=timeout,
                                         metadata=_deadline_metadata(timeout))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return convert.status_from_proto(reply)

    def _call(self, method, request):
        try:
            return method(request, timeout=self.timeout, metadata=_deadline_metadata(self.timeout))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the channel connects."""
        grpc.channel_ready_future(self._channel).result(timeout=timeout)

    def info(self) -> ModelInfo:
        return convert.model_info_from_proto(self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(model=self.model)))

    def capabilities(self) -> Capabilities:
        return convert.capabilities_from_proto(
            self._call(self._stub.GetCapabilities, pb.GetCapabilitiesRequest(model=self.model)))

    def status(self) -> ExecutorStatus:
        return convert.status_from_proto(self._call(self._stub.GetStatus, pb.GetStatusRequest(model=self.model)))

    def prefill(self, token_ids: Sequence[int], kv_cache: KvCacheHandle | None = None,
                logits: LogitsPolicy = LogitsPolicy(),
                hidden_states: HiddenStatesRequest | None = None) -> PrefillOutput:
        """Runs a prompt, or continues ``kv_cache`` with the next chunk of one; with
        ``hidden_states``, also returns those layers' hidden states (``out.hidden_states``)."""
        reply = self._call(self._stub.Prefill, self._prefill_req(token_ids, kv_cache, logits, hidden_states))
        return self._prefill_output(reply)

    def decode(self, token_id: int, kv_cache: KvCacheHandle, logits: LogitsPolicy = LogitsPolicy()) -> DecodeOutput:
        reply = self._call(self._stub.Decode, self._decode_req(token_id, kv_cache, logits))
        return self._output(DecodeOutput, reply)

    def batch_decode(self, items: Iterable[DecodeItem], logits: LogitsPolicy = LogitsPolicy()) -> list[DecodeOutput]:
        """One batched forward; outputs in the order of ``items``."""
        try:
            replies = list(self._stub.BatchDecode(self._batch_req(items, logits), timeout=self.timeout,
                                                  metadata=_deadline_metadata(self.timeout)))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._batch_outputs(replies)

    def forward_verify(self, token_ids: Sequence[int], kv_cache: KvCacheHandle,
                       logits: LogitsPolicy = LogitsPolicy()) -> VerifyOutput:
        reply = self._call(self._stub.ForwardVerify, self._verify_req(token_ids, kv_cache, logits))
        return self._output(VerifyOutput, reply)

    def speculative_decode(self, token_id: int, draft: Sequence[int], kv_cache: KvCacheHandle,
                           logits: LogitsPolicy = LogitsPolicy(),
                           sampling: SpeculativeSampling | None = None) -> SpeculativeOutput:
        """One round of server-side speculative decoding: ``token_id`` (the last sampled
        token) and ``draft`` verified in one forward, the agreeing drafts kept (greedy),
        or with ``sampling`` the drafts probabilistic acceptance keeps."""
        reply = self._call(self._stub.SpeculativeDecode,
                           self._speculative_req(token_id, draft, kv_cache, logits, sampling))
        return self._speculative_output(reply)

    def batch_prefill(self, prompts: Iterable[Sequence[int] | tuple[Sequence[int], KvCacheHandle]],
                      logits: LogitsPolicy = LogitsPolicy()) -> list[PrefillOutput]:
        """Several prompts (token ids, or ``(token_ids, handle)`` to continue one) in one
        call, run as shared forwards; outputs in order.  All or nothing."""
        try:
            replies = list(self._stub.BatchPrefill(self._batch_prefill_req(prompts, logits), timeout=self.timeout,
                                                   metadata=_deadline_metadata(self.timeout)))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._batch_prefill_outputs(replies)

    def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int) -> KvCacheHandle:
        req = pb.TruncateKvRequest(kv_cache=convert.handle_to_proto(kv_cache), new_length=new_length)
        return convert.handle_from_proto(self._call(self._stub.TruncateKv, req).kv_cache)

    def release_cache(self, cache: KvCacheHandle | str) -> int:
        """Frees a sequence (handle or cache_id); returns the blocks freed."""
        return self._call(self._stub.ReleaseCache, self._release_req(cache)).blocks_freed

    def fork_cache(self, kv_cache: KvCacheHandle, num_children: int) -> list[KvCacheHandle]:
        """N handles sharing ``kv_cache``'s blocks (copied on first divergent write)."""
        req = pb.ForkCacheRequest(kv_cache=convert.handle_to_proto(kv_cache), num_children=num_children)
        return [convert.handle_from_proto(h) for h in self._call(self._stub.ForkCache, req).children]

    def decode_session(self) -> DecodeSession:
        """Opens a DecodeSession stream: ``session.step(items)`` per step, no per-call setup."""
        return DecodeSession(self._stub, self.model, self.timeout, self._regions)

    def list_models(self) -> list[pb.ModelEntry]:
        """Every hosted model: name, state, folder, default flag and live status."""
        return list(self._call(self._stub.ListModels, pb.ListModelsRequest()).models)

    def load_model(self, name: str, path: str, progress=None) -> None:
        """Loads the model in ``path`` (a folder on the server) as ``name``; returns once
        it serves.  ``progress(stage, elapsed_s)`` sees each stage."""
        try:
            for message in self._stub.LoadModel(pb.LoadModelRequest(name=name, path=path), timeout=self.timeout,
                                                metadata=_deadline_metadata(self.timeout)):
                if progress is not None:
                    progress(message.stage, message.elapsed_s)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    def unload_model(self, name: str) -> int:
        """Stops serving ``name`` (its sequences go); returns how many sequences it held."""
        return self._call(self._stub.UnloadModel, pb.UnloadModelRequest(name=name)).sequences_dropped

    def shared_memory(self, byte_size: int, name: str | None = None) -> SharedMemoryRegion:
        """Creates a POSIX shared-memory object of ``byte_size`` bytes and registers it
        with the server (same host only); requests whose full-logits policy names
        ``region.target()`` get their rows written there.  Close it (or use ``with``)."""
        return SharedMemoryRegion(self._stub, byte_size, name, registry=self._regions)

    def close(self) -> None:
        for region in list(self._regions.values()):
            region.close()
        self._channel.close()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncExecutorClient(_Codec):
    """asyncio client with the same methods as :class:`ExecutorClient`, awaitable."""

    def __new__(cls, target: str | Sequence[str], *args, **kwargs):
        return super().__new__(_replica_class(cls, target, aio=True))

    def __init__(self, target: str | Sequence[str], *, model: str = "", timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ClientTls | None = None,
                 token: str | None = None, failover: bool = True, replica_policy=None,
                 channel_options: Sequence[tuple[str, object]] = (),
                 keepalive: Keepalive | None = DEFAULT_KEEPALIVE):
        self.model, self.timeout = model, timeout
        options = _options(max_message_bytes, keepalive) + list(channel_options)
        self._channel = _channel(_single(target), options, tls, token, aio=True)
        self._stub = pb_grpc.ModelExecutorStub(self._channel)
        self._regions: dict[str, AsyncSharedMemoryRegion] = {}

    async def _status_probe(self, timeout: float) -> ExecutorStatus:
        try:
            reply = await self._stub.GetStatus(pb.GetStatusRequest(model=self.model), timeout=timeout,
                                               metadata=_deadline_metadata(timeout))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return convert.status_from_proto(reply)

    async def _call(self, method, request):
        try:
            return await method(request, timeout=self.timeout, metadata=_deadline_metadata(self.timeout))
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None

    async def info(self) -> ModelInfo:
        return convert.model_info_from_proto(
            await self._call(self._stub.GetModelInfo, pb.GetModelInfoRequest(model=self.model)))

    async def capabilities(self) -> Capabilities:
        return convert.capabilities_from_proto(
            await self._call(self._stub.GetCapabilities, pb.GetCapabilitiesRequest(model=self.model)))

    async def status(self) -> ExecutorStatus:
        return convert.status_from_proto(await self._call(self._stub.GetStatus, pb.GetStatusRequest(model=self.model)))

    async def prefill(self, token_ids: Sequence[int], kv_cache: KvCacheHandle | None = None,
                      logits: LogitsPolicy = LogitsPolicy(),
                      hidden_states: HiddenStatesRequest | None = None) -> PrefillOutput:
        reply = await self._call(self._stub.Prefill, self._prefill_req(token_ids, kv_cache, logits, hidden_states))
        return self._prefill_output(reply)

    async def decode(self, token_id: int, kv_cache: KvCacheHandle,
                     logits: LogitsPolicy = LogitsPolicy()) -> DecodeOutput:
        reply = await self._call(self._stub.Decode, self._decode_req(token_id, kv_cache, logits))
        return self._output(DecodeOutput, reply)

    async def batch_decode(self, items: Iterable[DecodeItem],
                           logits: LogitsPolicy = LogitsPolicy()) -> list[DecodeOutput]:
        try:
            replies = [r async for r in self._stub.BatchDecode(self._batch_req(items, logits), timeout=self.timeout,
                                                               metadata=_deadline_metadata(self.timeout))]
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._batch_outputs(replies)

    async def forward_verify(self, token_ids: Sequence[int], kv_cache: KvCacheHandle,
                             logits: LogitsPolicy = LogitsPolicy()) -> VerifyOutput:
        reply = await self._call(self._stub.ForwardVerify, self._verify_req(token_ids, kv_cache, logits))
        return self._output(VerifyOutput, reply)

    async def speculative_decode(self, token_id: int, draft: Sequence[int], kv_cache: KvCacheHandle,
                                 logits: LogitsPolicy = LogitsPolicy(),
                                 sampling: SpeculativeSampling | None = None) -> SpeculativeOutput:
        reply = await self._call(self._stub.SpeculativeDecode,
                                 self._speculative_req(token_id, draft, kv_cache, logits, sampling))
        return self._speculative_output(reply)

    async def batch_prefill(self, prompts, logits: LogitsPolicy = LogitsPolicy()) -> list[PrefillOutput]:
        try:
            replies = [r async for r in self._stub.BatchPrefill(self._batch_prefill_req(prompts, logits),
                                                                timeout=self.timeout,
                                                                metadata=_deadline_metadata(self.timeout))]
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._batch_prefill_outputs(replies)

    async def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int) -> KvCacheHandle:
        req = pb.TruncateKvRequest(kv_cache=convert.handle_to_proto(kv_cache), new_length=new_length)
        return convert.handle_from_proto((await self._call(self._stub.TruncateKv, req)).kv_cache)

    async def release_cache(self, cache: KvCacheHandle | str) -> int:
        return (await self._call(self._stub.ReleaseCache, self._release_req(cache))).blocks_freed

    async def fork_cache(self, kv_cache: KvCacheHandle, num_children: int) -> list[KvCacheHandle]:
        req = pb.ForkCacheRequest(kv_cache=convert.handle_to_proto(kv_cache), num_children=num_children)
        return [convert.handle_from_proto(h) for h in (await self._call(self._stub.ForkCache, req)).children]

    def decode_session(self) -> AsyncDecodeSession:
        """Opens a DecodeSession stream: ``await session.step(items)`` per step."""
        return AsyncDecodeSession(self._stub, self.model, self.timeout, self._regions)

    async def shared_memory(self, byte_size: int, name: str | None = None) -> AsyncSharedMemoryRegion:
        """As :meth:`ExecutorClient.shared_memory`; close with ``await region.aclose()``."""
        return await AsyncSharedMemoryRegion.open(self._stub, byte_size, name, registry=self._regions)

    async def close(self) -> None:
        for region in list(self._regions.values()):
            await region.aclose()
        await self._channel.close()

    async def __aenter__(self) -> AsyncExecutorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


class DecodeSession(_Codec):
    """A bidirectional decode stream used step by step from one thread.

    Each :meth:`step` sends one request (any number of sequences) and waits for
    its replies; a failed step raises the table's exception and the session
    stays usable.  Close it (or use ``with``) to end the stream.
    """

    _END = object()

    def __init__(self, stub: pb_grpc.ModelExecutorStub, model: str, timeout: float | None,
                 regions: dict | None = None):
        import queue

        self.model, self._regions = model, regions if regions is not None else {}
        self._requests: queue.Queue = queue.Queue()
        self._responses = stub.DecodeSession(iter(self._requests.get, self._END), timeout=timeout,
                                             metadata=_deadline_metadata(timeout))
        self._next_step = 0

    def step(self, items: Iterable[DecodeItem], logits: LogitsPolicy = LogitsPolicy()) -> list[DecodeOutput]:
        self._next_step += 1
        request = self._session_req(self._next_step, items, logits)
        self._requests.put(request)
        replies = []
        try:
            while len(replies) < len(request.items):
                reply = next(self._responses)
                if reply.HasField("error"):
                    raise from_status_proto(reply.error)
                replies.extend(reply.results or [reply])
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._batch_outputs(replies)

    def close(self) -> None:
        self._requests.put(self._END)
        for _ in self._responses:  # let the server finish the stream cleanly
            pass

    def __enter__(self) -> DecodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncDecodeSession(_Codec):
    """:class:`DecodeSession` for asyncio: ``async with client.decode_session() as s``."""

    def __init__(self, stub: pb_grpc.ModelExecutorStub, model: str, timeout: float | None,
                 regions: dict | None = None):
        self.model, self._regions = model, regions if regions is not None else {}
        self._call = stub.DecodeSession(timeout=timeout, metadata=_deadline_metadata(timeout))
        self._next_step = 0

    async def step(self, items: Iterable[DecodeItem], logits: LogitsPolicy = LogitsPolicy()) -> list[DecodeOutput]:
        self._next_step += 1
        request = self._session_req(self._next_step, items, logits)
        replies = []
        try:
            await self._call.write(request)
            while len(replies) < len(request.items):
                reply = await self._call.read()
                if reply is grpc.aio.EOF:
                    raise ExecutorError("the session stream ended", code=grpc.StatusCode.UNAVAILABLE)
                if reply.HasField("error"):
                    raise from_status_proto(reply.error)
                replies.extend(reply.results or [reply])
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        return self._batch_outputs(replies)

    async def close(self) -> None:
        await self._call.done_writing()
        while await self._call.read() is not grpc.aio.EOF:  # let the server finish cleanly
            pass

    async def __aenter__(self) -> AsyncDecodeSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
