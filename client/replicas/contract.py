"""A replica set's public calls, each written once as a flow over :class:`~.routing._Routing`.

:class:`_Contract` holds one function per call of the single-target client's
contract (the replica set is ``self``); :data:`DRIVEN` turns each into a method
that runs the flow with its object's driver, for the blocking and the asyncio
replica-set clients alike.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Sequence

import grpc

from .actions import Flow, _Call
from .batches import _entries, _item_choices, _prompt_choices, _prompt_entries
from ..ahead import AheadResult, run_ahead, run_ahead_async
from ..client import AsyncExecutorClient
from ..disagg import DECODE
from ..rpc import RPCS, DecodeItem, Prompt, Rpc, method
from ferrum_rpc import sequence_file
from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.types import (
    DecodeInput,
    HiddenStatesRequest,
    KvCacheHandle,
    LogitsPolicy,
    SpeculativeSampling,
    TokenChoice,
)


class _Contract:
    """A replica set's public calls, each written once as a flow (``self`` is the set's
    :class:`~.routing._Routing`); :class:`ReplicaSetClient` and :class:`AsyncReplicaSetClient`
    get one method per function here (:data:`DRIVEN`), which drives the flow."""

    def replica_of(self, handle: KvCacheHandle):
        """The target that owns ``handle``'s sequence now (after any failover); a handle
        this client does not track goes by its instance id, replicas not yet asked
        probed first (StaleHandle when it is none of them)."""
        seq, _ = self._fleet.resolve(handle)
        owner = seq.replica if seq is not None else (yield from self.placement.owner_flow(handle))
        return owner.target

    def replica_status(self):
        """Every replica's GetStatus now (or the error asking it gave)."""
        return {r.target: out for r, out in zip(self._fleet.replicas, (yield from self.placement.statuses_flow()))}

    def wait_ready(self, timeout: float = 30.0):
        """Waits until every replica serves the model (each within ``timeout``; see
        ``ExecutorClient.wait_ready``)."""
        for replica in self._fleet.replicas:
            yield _Call(replica, "wait_ready", (timeout,), False)

    def prefill(self, token_ids: Sequence[int], kv_cache: KvCacheHandle | None = None,
                logits: LogitsPolicy | None = None, hidden_states: HiddenStatesRequest | None = None,
                token_choice: TokenChoice | None = None, request_id: str | None = None, adapter: str = ""):
        """A new prompt placed by load (or prefix locality) on a replica holding its
        ``adapter``; a continuation on its owner."""
        tokens = list(token_ids)
        if kv_cache is None:
            return (yield from self.placement.new_sequence_flow(
                tokens, lambda r: _Call(r, "prefill", (tokens, None, logits, hidden_states, token_choice,
                                                       request_id, adapter)), adapter))
        return (yield from self.failovers.sequence_flow(
            kv_cache, lambda r, h: _Call(r, "prefill", (tokens, h, logits, hidden_states, token_choice, request_id,
                                                        adapter)),
            lambda out: tokens, prompt=True))

    def decode(self, token_id: int, kv_cache: KvCacheHandle, logits: LogitsPolicy | None = None,
               token_choice: TokenChoice | None = None):
        return (yield from self.failovers.sequence_flow(
            kv_cache, lambda r, h: _Call(r, "decode", (token_id, h, logits, token_choice)), lambda out: [token_id]))

    def batch_decode(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                     token_choice: TokenChoice | None = None):
        """One batched forward per owning replica, in parallel; outputs in the order of ``items``."""
        items = list(items)
        choices = _item_choices(items, token_choice)

        def call_for(replica, group):
            return _Call(replica, "batch_decode",
                         ([DecodeInput(i.tokens[0], i.send, choices[i.index]) for i in group], logits))
        return (yield from self.batches.batch_flow(_entries(items), call_for))

    def decode_ahead(self, token_id: int, kv_cache: KvCacheHandle, token_choice: TokenChoice,
                     max_new_tokens: int, stop_token_ids: Sequence[int] = (), on_token=None):
        """Decoding ahead on the sequence's owner (:meth:`ExecutorClient.decode_ahead`).  If
        the owner is lost mid-run, the sequence is rebuilt elsewhere from its history and
        the run goes on there from the last token received: the tokens already emitted
        are appended first, so a greedy or seeded choice gives the tokens the lost run
        would have given (an unseeded one draws afresh from there)."""
        got, stopped = [], [False]
        return (yield from self.failovers.sequence_flow(
            kv_cache, lambda r, h: _Call(r, _run_ahead, (h, token_id, token_choice, max_new_tokens, stop_token_ids,
                                                         got, on_token, stopped)),
            lambda out: [token_id] + [c.token_id for c in out.chosen[:-1]]))

    def forward_verify(self, token_ids: Sequence[int], kv_cache: KvCacheHandle,
                       logits: LogitsPolicy = LogitsPolicy()):
        tokens = list(token_ids)
        return (yield from self.failovers.sequence_flow(
            kv_cache, lambda r, h: _Call(r, "forward_verify", (tokens, h, logits)), lambda out: tokens))

    def speculative_decode(self, token_id: int, draft: Sequence[int], kv_cache: KvCacheHandle,
                           logits: LogitsPolicy | None = None, sampling: SpeculativeSampling | None = None,
                           token_choice: TokenChoice | None = None):
        return (yield from self.failovers.sequence_flow(
            kv_cache, lambda r, h: _Call(r, "speculative_decode", (token_id, draft, h, logits, sampling,
                                                                   token_choice)),
            lambda out: [token_id, *out.accepted_token_ids]))

    def batch_prefill(self, prompts: Iterable[Prompt], logits: LogitsPolicy | None = None,
                      token_choice: TokenChoice | Sequence[TokenChoice | None] | None = None,
                      adapters: str | Sequence[str] = ""):
        """New prompts placed by load, continuations on their owners; one call per replica."""
        prompts = list(prompts)
        choices = _prompt_choices(len(prompts), token_choice)
        adapters = [adapters] * len(prompts) if isinstance(adapters, str) else list(adapters)

        def call_for(replica, group):
            return _Call(replica, "batch_prefill",
                         ([i.tokens if i.send is None else (i.tokens, i.send) for i in group], logits,
                          [choices[i.index] for i in group], [adapters[i.index] for i in group]))
        return (yield from self.batches.batch_flow(_prompt_entries(prompts), call_for, prompt=True))

    def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int):
        return (yield from self.failovers.sequence_flow(
            kv_cache, lambda r, h: _Call(r, "truncate_kv", (h, new_length)), lambda out: (),
            result_handle=lambda out: out, keep=new_length))

    def release_cache(self, cache: KvCacheHandle | str | None = None, request_id: str | None = None):
        if request_id is not None:
            return (yield from self.releases.release_name_flow(request_id))
        return (yield from self.releases.release_flow(cache))

    def fork_cache(self, kv_cache: KvCacheHandle, num_children: int):
        return (yield from self.failovers.fork_flow(kv_cache, num_children))

    def unload_model(self, name: str):
        """Unloads the model on every replica; returns the sequences dropped in all."""
        dropped = 0
        for replica in self._fleet.replicas:
            dropped += yield _Call(replica, "unload_model", (name,), False)
        return dropped

    def export_sequence(self, kv_cache: KvCacheHandle, file=None, chunk_bytes: int = 0):
        """Reads the sequence out of the replica that owns it (see ExecutorClient.export_sequence)."""
        seq, send = self._fleet.resolve(kv_cache)
        replica = seq.replica if seq is not None else (yield from self.placement.owner_flow(kv_cache))
        return (yield _Call(replica, "export_sequence", (send, file, chunk_bytes)))

    def import_sequence(self, data):
        """Into a replica placed as for a new sequence, and tracked from then on (its history,
        for a replay, is the export's when ``data`` is bytes; a file's is not kept)."""
        header = _export_header(data)
        tokens = list(header.token_ids) if header is not None else None
        replica = yield from self.placement.place_flow(tokens or [], role=DECODE)
        if replica is None:
            replica = min(self._fleet.replicas, key=lambda r: r.unusable_until)
        handle = yield _Call(replica, "import_sequence", (data,))
        spans = list(zip(header.prompt_spans[::2], header.prompt_spans[1::2])) if header is not None else []
        self._fleet.track(replica, tokens, handle, spans)
        return handle

    def create_import_ticket(self, fingerprint: str = "", ttl_s: float = 0.0):
        raise ExecutorError("an import ticket belongs to one server: ask that server's single-target client",
                            code=grpc.StatusCode.FAILED_PRECONDITION)
        yield  # never reached: makes this a flow

    def push_sequence(self, kv_cache: KvCacheHandle, target: str, ticket: str, move: bool = False,
                      chunk_bytes: int = 0):
        """The owner pushes the sequence to ``target``; a move stops tracking it here."""
        seq, send = self._fleet.resolve(kv_cache)
        replica = seq.replica if seq is not None else (yield from self.placement.owner_flow(kv_cache))
        out = yield _Call(replica, "push_sequence", (send, target, ticket, move, chunk_bytes))
        if seq is not None and out.released:
            self._fleet.forget(seq)
        return out

    def shared_memory(self, byte_size: int, name: str | None = None):
        raise ExecutorError("shared-memory regions belong to one server: open them on a single-target client",
                            code=grpc.StatusCode.FAILED_PRECONDITION)
        yield  # never reached: makes this a flow


def _run_ahead(client, *args):
    """One decode-ahead run on ``client`` (:func:`~ferrum_rpc.client.ahead.run_ahead`, or its
    asyncio twin for an asyncio client)."""
    return (run_ahead_async if isinstance(client, AsyncExecutorClient) else run_ahead)(client, *args)


def _export_header(data):
    """The header of an export held as bytes (None for a file: it is read once, as it goes)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    first = next(iter(sequence_file.messages(data)), None)
    return first.header if first is not None and first.HasField("header") else None


_RESULTS = {rpc.name: rpc.returns for rpc in RPCS}  # a replica set's calls return what a server's do
_RESULTS["decode_ahead"] = AheadResult


def _driven(flow: Callable[..., Flow], name: str | None = None,
            over: Callable[[Any], Any] = lambda obj: obj.routing) -> Callable[[bool], Callable]:
    """``make(aio)`` for the method (named ``name``, by default the flow's) that runs
    ``flow`` over ``over(obj)`` (a replica set's routing) with its object's ``_drive``."""
    name = name or flow.__name__
    return lambda aio: method(name, flow, _RESULTS.get(name, inspect.Signature.empty),
                              lambda self, *args, **kwargs: self._drive(flow(over(self), *args, **kwargs)), aio)


def _table_flow(rpc: Rpc) -> Callable[..., Flow]:
    """The flow of a call the clients' table marks ``replicas="any"`` (one usable
    replica answers) or ``"every"`` (each replica in turn; the last one's result), with
    the call's parameters and docstring."""
    signature = inspect.signature(rpc.request)

    def flow(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        args = tuple(bound.arguments.values())[1:]
        if rpc.replicas == "any":
            return (yield from self.placement.any_flow(rpc.name, args))
        result = None
        for replica in self._fleet.replicas:
            result = yield _Call(replica, rpc.name, args, False)
        return result

    flow.__signature__ = signature
    flow.__name__ = flow.__qualname__ = rpc.name
    flow.__doc__ = (rpc.request.__doc__ or "") + ("" if rpc.replicas == "any" else
                                                  "\n\n    On a replica set: on every replica, one after another.")
    return flow


for _rpc in RPCS:  # the calls with no flow written above
    if _rpc.replicas and _rpc.name not in vars(_Contract):
        setattr(_Contract, _rpc.name, _table_flow(_rpc))

# What ReplicaSetClient and AsyncReplicaSetClient get: a method per call of _Contract.
DRIVEN = {name: _driven(flow) for name, flow in vars(_Contract).items() if inspect.isfunction(flow)}
