"""The single-target clients: :class:`ExecutorClient` (blocking) and
:class:`AsyncExecutorClient` (asyncio).

Their RPC methods come from one table (``ferrum_rpc.client.rpc.RPCS``: request
builder, reply parser, streaming shape), each driven by the class's invoker
(``_invoke``): the call's deadline and its ``ferrum-deadline-unix-ns`` header, and
``grpc.RpcError`` turned into the error table's exceptions
(``ferrum_rpc.errors.from_rpc_error``).  Replica sets build on these clients
(``ferrum_rpc.client.replicas``; :func:`~ferrum_rpc.client.replicas.connect`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence
from urllib.parse import urlsplit

import grpc
import grpc.experimental

from . import admin
from .ahead import (
    AheadResult,
    run_ahead,
    run_ahead_async,
)
from .ready import Readiness
from .rpc import INVOKED, STATUS, DecodeItem, Rpc, with_methods
from .session import AsyncDecodeSession, DecodeSession
from .shm import AsyncSharedMemoryRegion, SharedMemoryRegion
from ferrum_rpc.errors import ExecutorError, RequestIdExists, from_rpc_error
from ferrum_rpc.metadata import deadline_metadata
from ferrum_rpc.types import KvCacheHandle, TokenChoice
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 512 << 20  # above the server's default 256 MiB reply limit
# The caller's deadline as wall-clock time (ns since the Unix epoch), sent beside gRPC's
# relative timeout: gRPC sends "N seconds from now" and the server counts from when it
# reads the headers, so a call that sat in a frozen server's socket past its deadline
# would run with a fresh one on resume.  Optional; relies on synchronized clocks.
GRPC_DEFAULT_PORT = 443  # what gRPC's dns resolver assumes when a target names no port
_CLIENT_TIMEOUT = object()  # _invoke: the client's own timeout
RELEASE_TIMEOUT_S = 5.0  # the release by request_id after a call whose outcome is unknown


@contextlib.contextmanager
def _errors_mapped(client, rpc: Rpc, request, args: tuple, kwargs: dict):
    """Both invokers' errors: ``grpc.RpcError`` becomes the error table's exception, and a
    call that ended with its outcome unknown (cancelled, timed out, interrupted, the
    connection lost) has what it may have created under names the client generated
    released by request_id."""
    try:
        yield
    except grpc.RpcError as exc:
        err = from_rpc_error(exc)
        if err.outcome_unknown:  # the call may have run: what it may have created goes
            client._release_created(rpc, request, args, kwargs)
        raise err from None
    except BaseException:  # interrupted or cancelled while waiting: the call may have run
        client._release_created(rpc, request, args, kwargs)
        raise


def _release_request(request, name: str):
    return pb.ReleaseCacheRequest(request_id=name, model=request.model)

__all__ = ["AsyncExecutorClient", "ClientTls", "DecodeItem", "ExecutorClient", "Keepalive", "resolve_targets"]


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
    if not aio:
        # A server-streaming call (BatchDecode, BatchPrefill, ExportSequence) is driven on the
        # calling thread (grpc's own option): by default grpc starts a thread to drive the
        # calls of a channel with none in flight, so a caller decoding one sequence paid a
        # thread start on every step (tests/system/test_client_threads.py).
        options = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1), *options]
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


def resolve_targets(target: str | Sequence[str]) -> list[str]:
    """The replica addresses a target names, in order, without duplicates.

    A list gives its items (each resolved in turn); ``ipv4:a:p,b:p`` and
    ``ipv6:[a]:p,[b]:p`` give their addresses; ``dns:[//authority/]host[:port]``
    gives every address the name resolves to (one address: the target as given,
    so TLS names and gRPC's own resolution stay as they were).  Anything else is
    one target."""
    if not isinstance(target, str):
        found = [t for item in target for t in resolve_targets(item)]
        return list(dict.fromkeys(found))
    scheme, _, rest = target.partition(":")
    if scheme in ("ipv4", "ipv6") and "," in rest:
        return list(dict.fromkeys(a.strip() for a in rest.split(",") if a.strip()))
    if scheme == "dns":
        addresses = _resolve_dns(rest)
        return addresses if len(addresses) > 1 else [target]
    return [target]


def _resolve_dns(rest: str) -> list[str]:
    name = rest.split("/", 3)[-1] if rest.startswith("//") else rest
    parts = urlsplit(f"//{name}")
    host, port = parts.hostname, parts.port or GRPC_DEFAULT_PORT
    if not host:
        return []
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        log.warning("could not resolve %s (%s); using it as one target", host, exc)
        return []
    out = []
    for family, *_, address in infos:
        ip = address[0]
        out.append(f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}")
    return list(dict.fromkeys(out))


def _single(target: str | Sequence[str]) -> str:
    """The one address of a single-target client (a plain string, or a list of one)."""
    targets = resolve_targets(target)
    if len(targets) != 1:
        raise ValueError(f"{target!r} names {len(targets)} servers; a single-target client takes one "
                         "(ferrum_rpc.client.connect(targets) gives a replica-set client)")
    return target if isinstance(target, str) else targets[0]


class _Client:
    """What both single-target clients share: the channel, the stub, the model addressed
    and the shared-memory regions registered (which the reply parsers read)."""

    _aio: bool

    def __init__(self, target: str | Sequence[str], *, model: str = "", timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ClientTls | None = None,
                 token: str | None = None, failover: bool = True, replica_policy=None,
                 channel_options: Sequence[tuple[str, object]] = (),
                 keepalive: Keepalive | None = DEFAULT_KEEPALIVE):
        self.model, self.timeout, self.target = model, timeout, _single(target)
        options = _options(max_message_bytes, keepalive) + list(channel_options)
        self._channel = _channel(self.target, options, tls, token, aio=self._aio)
        self._stub = pb_grpc.ModelExecutorStub(self._channel)
        # UpdateWeights' data messages arrive from the request builder written on the wire already
        self._stub.UpdateWeights = self._channel.stream_unary(
            "/ferrum.executor.v1.ModelExecutor/UpdateWeights", request_serializer=admin.serialize_chunk,
            response_deserializer=pb.UpdateWeightsResponse.FromString, _registered_method=True)
        self._regions: dict[str, Any] = {}
        self._releasing: set = set()  # asyncio client: releases by request_id still running

    def _status_probe(self, timeout: float):
        """GetStatus with its own deadline (replica sets probe with a short one); awaitable
        on the asyncio client."""
        return self._invoke(STATUS, (), {}, timeout)

    def _call_args(self, rpc: Rpc, args: tuple, kwargs: dict, timeout) -> tuple[Any, Any, dict]:
        """The stub method, request and call options of one call."""
        timeout = self.timeout if timeout is _CLIENT_TIMEOUT else timeout
        request = rpc.request(self, *args, **kwargs)
        return getattr(self._stub, rpc.method), request, dict(timeout=timeout, metadata=deadline_metadata(timeout))


@with_methods(INVOKED, aio=False)
class ExecutorClient(_Client):
    """Blocking client of one server (several: :func:`~ferrum_rpc.client.replicas.connect`).

    Args:
        target: "host:port" of a ferrum-rpc server (or a list of one).
        model: the hosted model to address; "" means the server's default.
        timeout: per-call deadline in seconds (None: no deadline).
        max_message_bytes: largest reply accepted.
        tls: connect with TLS (and a client certificate for mTLS); None: plaintext.
        token: bearer token sent on every call (servers run with ``--auth-tokens``);
            only over TLS or to a loopback address.
        failover, replica_policy: replica sets only
            (:class:`~ferrum_rpc.client.replicas.ReplicaSetClient`); ignored here.
        channel_options: extra gRPC channel arguments.
        keepalive: HTTP/2 keepalive pings (:class:`Keepalive`: every 2 s, 2 s to answer),
            so a server that stops answering ends the calls on it with UNAVAILABLE
            within a few seconds; None: gRPC's defaults (no pings).

    With a ``timeout``, each call also carries its absolute deadline (metadata
    ``ferrum-deadline-unix-ns``), so a server that reads the call late (it was frozen
    or stalled) refuses it instead of running it after the caller gave up.

    The RPC methods (``prefill``, ``decode``, ...) are those of
    ``ferrum_rpc.client.rpc.RPCS``.
    """

    _aio = False

    def _invoke(self, rpc: Rpc, args: tuple, kwargs: dict, timeout=_CLIENT_TIMEOUT):
        """The sync invoker: one call of ``rpc``, its reply (or replies) parsed."""
        method, request, options = self._call_args(rpc, args, kwargs, timeout)
        try:
            with _errors_mapped(self, rpc, request, args, kwargs):
                call = method(request, **options)
                if rpc.stream:
                    call = [rpc.seen(self, message, args, kwargs) for message in call]
        except RequestIdExists as exc:  # a retry whose first attempt made the sequence
            return rpc.answered(self, exc)
        return rpc.result(self, call, args, kwargs)

    def _release_created(self, rpc: Rpc, request, args: tuple, kwargs: dict) -> None:
        """Releases, by request_id, what a call whose outcome is unknown may have created
        under names the client generated."""
        for name in rpc.names(request, args, kwargs) if rpc.names is not None else ():
            try:
                self._stub.ReleaseCache(_release_request(request, name), timeout=RELEASE_TIMEOUT_S)
            except grpc.RpcError as exc:
                log.info("releasing request_id %s after a lost reply failed: %s", name, exc.code())

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Blocks until the server serves this client's model, so that the next call is
        not refused MODEL_LOADING: the channel connects, then GetStatus is asked (pauses of
        20 ms growing to 0.5 s) until it answers STATE_SERVING for the model.  While the
        server starts it answers STATE_LOADING, and while LoadModel loads the model,
        MODEL_LOADING; both are waited out, as is a lost connection.

        Raises :class:`~ferrum_rpc.errors.NotServing` (a ``grpc.FutureTimeoutError``)
        once ``timeout`` seconds pass, naming what it saw last; ``Draining`` for a server
        shutting down; and at once whatever waiting cannot change (MODEL_NOT_FOUND,
        UNAUTHENTICATED, ...)."""
        ready = Readiness(self, timeout)
        try:
            grpc.channel_ready_future(self._channel).result(timeout=ready.left())
        except grpc.FutureTimeoutError:
            raise ready.expired() from None
        while not ready.done(self._asked(ready)):
            time.sleep(ready.pause())

    def _asked(self, ready: Readiness):
        """One GetStatus probe's outcome: the status, or the error it gave."""
        try:
            return self._status_probe(ready.left())
        except ExecutorError as err:
            return err

    def decode_session(self) -> DecodeSession:
        """Opens a DecodeSession stream: ``session.step(items)`` per step, no per-call setup."""
        return DecodeSession(self._stub, self.model, self.timeout, self._regions)

    def decode_ahead(self, token_id: int, kv_cache: KvCacheHandle, token_choice: TokenChoice,
                     max_new_tokens: int, stop_token_ids: Sequence[int] = (), on_token=None) -> AheadResult:
        """Appends ``token_id`` and lets the server choose and append up to ``max_new_tokens``
        tokens on its own (one DecodeSession step, each token streamed as it is chosen;
        see :mod:`ferrum_rpc.client.ahead`), to the end of the run.  ``on_token(chosen)``
        sees each token as it arrives; returning True stops the run after the server's
        current forward.  Without ``on_token`` the server sends the tokens a few forwards
        at a time (fewer messages, less CPU on both sides).  On a replica set a run whose owner is lost goes on elsewhere."""
        return run_ahead(self, kv_cache, token_id, token_choice, max_new_tokens, stop_token_ids, [], on_token,
                         [False])

    def shared_memory(self, byte_size: int, name: str | None = None) -> SharedMemoryRegion:
        """Registers a shared-memory region of ``byte_size`` bytes with the server (same
        host only): the server creates the POSIX object and names it in its first reply,
        and the client maps it and unlinks the name.  Requests whose full-logits policy
        names ``region.target()`` get their rows written there.  Close it (or use ``with``)."""
        return SharedMemoryRegion(self._stub, byte_size, name, registry=self._regions)

    def close(self) -> None:
        for region in list(self._regions.values()):
            region.close()
        self._channel.close()

    def __enter__(self) -> ExecutorClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@with_methods(INVOKED, aio=True)
class AsyncExecutorClient(_Client):
    """asyncio client with the same methods as :class:`ExecutorClient`, awaitable."""

    _aio = True

    async def _invoke(self, rpc: Rpc, args: tuple, kwargs: dict, timeout=_CLIENT_TIMEOUT):
        """The asyncio invoker: :meth:`ExecutorClient._invoke`, awaited."""
        method, request, options = self._call_args(rpc, args, kwargs, timeout)
        try:
            with _errors_mapped(self, rpc, request, args, kwargs):
                call = method(request, **options)
                if rpc.stream:
                    call = [rpc.seen(self, message, args, kwargs) async for message in call]
                else:
                    call = await call
        except RequestIdExists as exc:  # a retry whose first attempt made the sequence
            return rpc.answered(self, exc)
        return rpc.result(self, call, args, kwargs)

    def _release_created(self, rpc: Rpc, request, args: tuple, kwargs: dict) -> None:
        """:meth:`ExecutorClient._release_created`, as a task of its own (this one may be
        being cancelled); the client keeps it until it ends."""
        names = rpc.names(request, args, kwargs) if rpc.names is not None else []
        if not names:
            return

        async def release():
            for name in names:
                try:
                    await self._stub.ReleaseCache(_release_request(request, name), timeout=RELEASE_TIMEOUT_S)
                except grpc.RpcError as exc:
                    log.info("releasing request_id %s after a lost reply failed: %s", name, exc.code())

        task = asyncio.get_running_loop().create_task(release())
        self._releasing.add(task)
        task.add_done_callback(self._releasing.discard)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the server serves this client's model (as
        :meth:`ExecutorClient.wait_ready`, with the same errors)."""
        ready = Readiness(self, timeout)
        try:
            await asyncio.wait_for(self._channel.channel_ready(), ready.left())
        except asyncio.TimeoutError:
            raise ready.expired() from None
        while not ready.done(await self._asked(ready)):
            await asyncio.sleep(ready.pause())

    async def _asked(self, ready: Readiness):
        try:
            return await self._status_probe(ready.left())
        except ExecutorError as err:
            return err

    def decode_session(self) -> AsyncDecodeSession:
        """Opens a DecodeSession stream: ``await session.step(items)`` per step."""
        return AsyncDecodeSession(self._stub, self.model, self.timeout, self._regions)

    async def decode_ahead(self, token_id: int, kv_cache: KvCacheHandle, token_choice: TokenChoice,
                           max_new_tokens: int, stop_token_ids: Sequence[int] = (), on_token=None) -> AheadResult:
        """:meth:`ExecutorClient.decode_ahead` (``on_token`` may be a coroutine function)."""
        return await run_ahead_async(self, kv_cache, token_id, token_choice, max_new_tokens, stop_token_ids, [],
                                     on_token, [False])

    async def shared_memory(self, byte_size: int, name: str | None = None) -> AsyncSharedMemoryRegion:
        """As :meth:`ExecutorClient.shared_memory`; close with ``await region.aclose()``."""
        return await AsyncSharedMemoryRegion.open(self._stub, byte_size, name, registry=self._regions)

    async def close(self) -> None:
        if self._releasing:  # releases of lost replies go out before the channel closes
            await asyncio.wait(list(self._releasing), timeout=RELEASE_TIMEOUT_S)
        for region in list(self._regions.values()):
            await region.aclose()
        await self._channel.close()

    async def __aenter__(self) -> AsyncExecutorClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
