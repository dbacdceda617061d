"""The gRPC servicer: protobuf -> domain call on a model worker -> protobuf.

No torch here.  Every handler is wrapped by ``handler.py`` (tenant, admission,
metrics, and every exception to a status in one place, from the shared error
table); its parts serve the transfer RPCs (``migration.TransferRpcs``), the registry,
adapter and shared-memory RPCs (``admin.AdminRpcs``), WatchKvEvents
(``watch.KvEventRpcs``) and UpdateWeights (``weights.WeightsRpcs``).  Replies with results are
built by ``replies.Replies``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from ferrum_rpc import convert, tensor_codec
from ferrum_rpc.rules import MAX_DECODE_AHEAD, check_prefill_batch, check_release
from .auth import TokenTable
from . import session
from .ledger import Undelivered
from .replies import Replies
from .migration import TransferRpcs
from .push import PushConfig
from .admin import AdminRpcs
from .watch import KvEventRpcs
from .weights import WeightsRpcs
from .edge import deadline_of, required_handle
from .gate import Gate
from .handler import call, handler, query
from .hosting import HostedModels
from .shm import SharedMemoryRegistry
from ..engine.facade import ModelWorker
from ferrum_rpc.types import (
    DecodeInput,
    LogitsPolicy,
    ServerState,
    SpeculativeSampling,
    TokenChoice,
)
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

def _policy_or_unset(message) -> LogitsPolicy | None:
    """A request's logits policy; None when the field is unset (full float32 rows for
    requests without a token_choice, no logits for those with one)."""
    return convert.policy_from_proto(message.logits) if message.HasField("logits") else None


def _choice(worker: ModelWorker, message, field: str = "token_choice") -> TokenChoice | None:
    """A message's token_choice, validated (INVALID_INPUT naming ``field``); None if unset."""
    if not message.HasField("token_choice"):
        return None
    choice = convert.token_choice_from_proto(message.token_choice, field)
    worker.executor.check_token_choice(choice, field)
    return choice




class ExecutorServicer(pb_grpc.ModelExecutorServicer):
    """Routes each request to the worker of the model it names (empty = the default).
    The contract's calls are its own methods; the transfer, admin, KV-event and weights
    RPCs are those of its parts, which share its :class:`~.gate.Gate`."""

    def __init__(self, instance_id: str, tokens: TokenTable | None = None, metrics=None,
                 shared_memory: bool = False, admin_tenants: tuple[str, ...] = (), *, registry: HostedModels,
                 push: PushConfig = PushConfig(), transfer_budget_bytes: int = 0, import_idle_s: float = 30.0):
        self.gate = Gate(instance_id, registry, tokens, admin_tenants, metrics)
        self.shm = SharedMemoryRegistry()  # the callers' regions: RegisterSharedMemory's, read by FULL logits
        self.transfer_rpcs = TransferRpcs(self.gate, push, transfer_budget_bytes, import_idle_s)
        self.admin_rpcs = AdminRpcs(self.gate, self.shm, shared_memory, self.transfer_rpcs.transfer_figures)
        self.kv_event_rpcs = KvEventRpcs(self.gate)
        self.weights_rpcs = WeightsRpcs(self.gate, import_idle_s)
        self.sessions: set[session.DecodeSession] = set()  # running DecodeSession calls
        self.replies = Replies(self.shm)  # results into protobuf (large ones off the event loop)

    def rpc(self, name: str):
        """The handler of RPC ``name``: this servicer's, or the part's that serves it."""
        for owner in (self, self.transfer_rpcs, self.admin_rpcs, self.kv_event_rpcs, self.weights_rpcs):
            if name in type(owner).__dict__:
                return getattr(owner, name)
        return getattr(self, name)  # the generated base's UNIMPLEMENTED

    # -- the process's view (app.py; its entry state is the gate's) ---------------------------
    @property
    def transfers(self) -> int:
        """Exports, pushes and imports running now (a draining server waits for them)."""
        return self.transfer_rpcs.transfers

    def transfer_figures(self) -> dict[str, int]:
        return self.transfer_rpcs.transfer_figures()

    def end_watches(self) -> None:
        self.kv_event_rpcs.end_watches()

    def end_imports(self) -> None:
        self.transfer_rpcs.end_imports()

    def admit(self):
        return self.gate.admit()

    async def wait_idle(self) -> None:
        await self.gate.wait_idle()

    def observe(self, method: str, tenant: str, error: Exception | None, start: float, timing=None) -> None:
        self.gate.observe(method, tenant, error, start, timing)

    def decode_batch(self, request) -> tuple[ModelWorker, list[DecodeInput], LogitsPolicy]:
        """BatchDecode / DecodeSession request -> its model's worker, the items and the policy."""
        first = request.items[0].kv_cache.model if request.items else ""
        worker, policy = self.gate.worker(request.model or first), _policy_or_unset(request)
        items = [DecodeInput(i.token_id, required_handle(i), _choice(worker, i, f"items[{n}].token_choice"))
                 for n, i in enumerate(request.items)]
        rows = sum(1 for i in items if policy is not None or i.token_choice is None)  # chosen only: no row
        if request.single_reply and rows:  # every row in one message: it must fit the limit as a whole
            worker.executor.checks.reply_fits(policy or LogitsPolicy(), rows)
        return worker, items, policy

    # -- queries -----------------------------------------------------------------
    @query
    async def GetModelInfo(self, request, context, tenant: str):
        return convert.model_info_to_proto(self.gate.worker(request.model).executor.info())

    @query
    async def GetCapabilities(self, request, context, tenant: str):
        caps = convert.capabilities_to_proto(self.gate.worker(request.model).executor.capabilities())
        caps.models.extend(sorted(self.gate.workers))
        caps.shared_memory = self.admin_rpcs.shared_memory
        caps.max_decode_ahead = MAX_DECODE_AHEAD
        return caps

    @query
    async def GetStatus(self, request, context, tenant: str):
        if self.gate.state is ServerState.LOADING and not self.gate.workers:
            return pb.Status(state=pb.Status.STATE_LOADING, server_instance_id=self.gate.instance_id)
        worker = self.gate.worker(request.model)
        status = await worker.front.call(worker.executor.status, self.gate.state, worker.work_queued, tenant)
        status = dataclasses.replace(status, ahead_sequences=sum(worker.ahead.values()),
                                     ahead_runs_paused=worker.ahead_paused,
                                     session_bytes_unsent=sum(s.unsent for s in self.sessions),
                                     **self.transfer_figures())
        return convert.status_to_proto(status)

    # -- the contract ----------------------------------------------------------------
    @call
    async def Prefill(self, request, context, tenant: str):
        received = time.perf_counter_ns()
        worker = self.gate.worker(request.model or request.kv_cache.model)
        handle = convert.handle_from_proto(request.kv_cache) if request.HasField("kv_cache") else None
        policy = _policy_or_unset(request)
        choice = _choice(worker, request)
        rows = len(request.token_ids) if policy is not None and policy.all_positions else 1
        hidden = convert.hidden_request_from_proto(request.hidden_states) if request.HasField("hidden_states") \
            else None
        with self.replies.logits_targets(policy, [rows], worker, tenant) as targets:
            out, undo = await worker.front.prefill(list(request.token_ids), handle, policy, deadline_of(context), hidden,
                                             tenant, choice, name=request.request_id, adapter=request.adapter)
            reply = pb.PrefillResponse(cached_tokens=out.cached_tokens)
            for array in out.hidden_states:
                tensor_codec.encode_into(reply.hidden_states.add(), array)
            for array in out.attention_weights:
                tensor_codec.encode_into(reply.attention_weights.add(), array)
            return await self.replies.reply(reply, out, received, worker, undo, targets[0])

    @call
    async def Decode(self, request, context, tenant: str):
        received = time.perf_counter_ns()
        worker = self.gate.worker(request.model or request.kv_cache.model)
        item = DecodeInput(request.token_id, required_handle(request), _choice(worker, request))
        policy = _policy_or_unset(request)
        with self.replies.logits_targets(policy, [1], worker, tenant) as targets:
            (out,), undo = await worker.front.decode([item], policy, deadline_of(context), tenant)
            return await self.replies.reply(pb.DecodeResponse(), out, received, worker, undo, targets[0])

    @call
    async def BatchDecode(self, request, context, tenant: str):
        received = time.perf_counter_ns()
        worker, items, policy = self.decode_batch(request)
        ledger = Undelivered()
        with self.replies.logits_targets(policy, [1] * len(items), worker, tenant) as targets:
            outs, undo = await worker.front.decode(items, policy, deadline_of(context), tenant)
            keys = self.replies.register_decodes(ledger, worker, undo)
            try:
                async for _, reply in self.replies.step_replies(pb.BatchDecodeResponse, {}, outs, received,
                                                         request.single_reply, targets, keys):
                    yield reply
            except BaseException:  # failed, cancelled or closed before its last reply: nothing stays
                ledger.abandon_rest()
                raise
            ledger.keep()

    @call
    async def ForwardVerify(self, request, context, tenant: str):
        received = time.perf_counter_ns()
        worker = self.gate.worker(request.model or request.kv_cache.model)
        handle = required_handle(request)
        policy = convert.policy_from_proto(request.logits)
        with self.replies.logits_targets(policy, [len(request.token_ids)], worker, tenant) as targets:
            out, undo = await worker.front.verify(list(request.token_ids), handle, policy, deadline_of(context), tenant)
            return await self.replies.reply(pb.ForwardVerifyResponse(), out, received, worker, undo,
                                     targets[0])

    @call
    async def TruncateKv(self, request, context, tenant: str):
        worker = self.gate.worker(request.kv_cache.model)
        handle = await worker.front.call(worker.executor.truncate_kv, required_handle(request),
                                   request.new_length, tenant, deadline=deadline_of(context))
        return pb.TruncateKvResponse(kv_cache=convert.handle_to_proto(handle))

    @call
    async def ReleaseCache(self, request, context, tenant: str):
        worker = self.gate.worker(request.model)
        check_release(request.cache_id, request.request_id)
        if request.request_id:
            return pb.ReleaseCacheResponse(blocks_freed=await worker.front.release_named(request.request_id, tenant))
        freed = await worker.front.call(worker.executor.release_cache, request.cache_id, tenant)
        return pb.ReleaseCacheResponse(blocks_freed=freed)

    @call
    async def ForkCache(self, request, context, tenant: str):
        worker = self.gate.worker(request.kv_cache.model)
        children, _ = await worker.front.fork(required_handle(request), request.num_children, deadline_of(context), tenant)
        return pb.ForkCacheResponse(children=[convert.handle_to_proto(c) for c in children])

    @call
    async def SpeculativeDecode(self, request, context, tenant: str):
        received = time.perf_counter_ns()
        worker = self.gate.worker(request.model or request.kv_cache.model)
        handle = required_handle(request)
        policy = _policy_or_unset(request)
        choice = _choice(worker, request)
        with self.replies.logits_targets(policy, [1], worker, tenant) as targets:
            sampling = None
            if request.HasField("sampling"):
                m = request.sampling
                sampling = SpeculativeSampling(m.temperature, m.top_k, m.top_p, m.seed)
            out, undo = await worker.front.speculative(request.token_id, list(request.draft_token_ids), handle, policy,
                                           deadline_of(context), sampling, tenant, choice)
            reply = pb.SpeculativeDecodeResponse(accepted_token_ids=out.accepted_token_ids,
                                                 next_token_id=out.next_token_id,
                                                 chosen=[convert.chosen_to_proto(c) for c in out.chosen])
            return await self.replies.reply(reply, out, received, worker, undo, targets[0])

    @call
    async def BatchPrefill(self, request, context, tenant: str):
        """Every prompt goes to the worker at once: their parts share forwards (ragged,
        under the step budget, with other callers' decodes); all or nothing."""
        received = time.perf_counter_ns()
        if not request.items:
            check_prefill_batch([], [], 0)
        first = next((i.kv_cache.model for i in request.items if i.HasField("kv_cache")), "")
        worker = self.gate.worker(request.model or first)
        handles = [convert.handle_from_proto(i.kv_cache) if i.HasField("kv_cache") else None
                   for i in request.items]
        check_prefill_batch([h.cache_id for h in handles if h is not None], [i.request_id for i in request.items],
                            len(request.items), worker.executor.limits)
        policy = _policy_or_unset(request)
        choices = [_choice(worker, item, f"items[{n}].token_choice") for n, item in enumerate(request.items)]
        rows = [len(i.token_ids) if policy is not None and policy.all_positions else 1 for i in request.items]
        deadline = deadline_of(context)
        with self.replies.logits_targets(policy, rows, worker, tenant) as targets:
            outs = await asyncio.gather(*(worker.front.prefill(list(item.token_ids), handle, policy, deadline, tenant=tenant,
                                                         choice=choice, name=item.request_id,
                                                         adapter=item.adapter)
                                          for item, handle, choice in zip(request.items, handles, choices)),
                                        return_exceptions=True)
            failed = next((o for o in outs if isinstance(o, BaseException)), None)
            if failed is not None:  # all or nothing: the prompts that ran are undone
                done = [record for o in outs if not isinstance(o, BaseException) for record in o.undo_records]
                if done:
                    await worker.front.call(worker.executor.undo, done)
                raise failed
            ledger = Undelivered()
            for done in outs:
                ledger.add(worker, done.undo_records)
            try:
                for index, (out, _) in enumerate(outs):
                    yield await self.replies.reply(pb.BatchPrefillResponse(index=index, cached_tokens=out.cached_tokens),
                                            out, received, target=targets[index])
            except BaseException:  # all or nothing, up to the last reply (see Undelivered.keep)
                ledger.abandon_rest()
                raise
            ledger.keep()

    @handler(admit=False, observe=False)  # each step is admitted and observed on its own
    async def DecodeSession(self, request_iterator, context, tenant: str):
        """Steps, decoding ahead and what a cancelled session undoes: see ``session.py``."""
        await session.DecodeSession(self, context, tenant, deadline_of(context)).serve(request_iterator)


    # -- sequences that move(the bodies are migration.TransferRpcs') ---------
    # Exports and pushes are answered while draining too: a drained replica's sequences
    # leave by them (see App.drain's export grace).

    async def Forward(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "Forward is not implemented: use Prefill/Decode (the executor trait's default)")
