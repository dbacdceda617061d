"""The gRPC servicer: protobuf -> domain call on a model worker -> protobuf.

No torch here.  Every exception becomes a status in one place
(``_abort``), using the shared error table; anything outside the table is
logged and answered INTERNAL without taking the server down.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import time

import grpc

from ferrum_rpc import convert
from ferrum_rpc.errors import (
    Draining,
    ExecutorError,
    InvalidInput,
    ModelLoading,
    ModelNotFound,
    to_rpc_status,
    to_status_proto,
)
from ferrum_rpc.server.worker import ModelWorker
from ferrum_rpc.types import DecodeInput, KvCacheHandle, LogitsPolicy, ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


def _as_executor_error(exc: Exception) -> ExecutorError:
    if isinstance(exc, ExecutorError):
        return exc
    log.exception("internal error", exc_info=exc)
    return ExecutorError(f"internal error: {type(exc).__name__}: {exc}", code=grpc.StatusCode.INTERNAL)


async def _abort(context: grpc.aio.ServicerContext, exc: Exception) -> None:
    await context.abort_with_status(to_rpc_status(_as_executor_error(exc)))




def _required_handle(message) -> KvCacheHandle:
    if not message.HasField("kv_cache"):
        raise InvalidInput("kv_cache is required")
    return convert.handle_from_proto(message.kv_cache)


def _query(method):
    """Error mapping only: queries are answered while draining too, so callers see the state."""
    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc)
    return unary


def _rpc(method):
    """Admission (draining/loading), in-flight accounting and error mapping for one RPC."""
    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                with self._admit():
                    async for reply in method(self, request, context):
                        yield reply
            except Exception as exc:
                await _abort(context, exc)
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            with self._admit():
                return await method(self, request, context)
        except Exception as exc:
            await _abort(context, exc)
    return unary


class ExecutorServicer(pb_grpc.ModelExecutorServicer):
    """Routes each request to the worker of the model it names (empty = the default)."""

    def __init__(self, instance_id: str):
        self.instance_id = instance_id
        self.state = ServerState.LOADING
        self.workers: dict[str, ModelWorker] = {}
        self.default_model = ""
        self.inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def add_model(self, worker: ModelWorker) -> None:
        name = worker.executor.name
        self.workers[name] = worker
        self.default_model = self.default_model or name

    # -- plumbing --------------------------------------------------------------
    class _Admission:
        def __init__(self, servicer: ExecutorServicer):
            self.servicer = servicer

        def __enter__(self):
            s = self.servicer
            if s.state is ServerState.DRAINING:
                raise Draining("the server is shutting down")
            s.inflight += 1
            s._idle.clear()

        def __exit__(self, *exc):
            s = self.servicer
            s.inflight -= 1
            if s.inflight == 0:
                s._idle.set()

    def _admit(self) -> ExecutorServicer._Admission:
        return self._Admission(self)

    async def wait_idle(self) -> None:
        """Returns once no RPC is in flight."""
        await self._idle.wait()

    def _worker(self, model: str) -> ModelWorker:
        if self.state is ServerState.LOADING and not self.workers:
            raise ModelLoading("the model is still loading")
        try:
            return self.workers[model or self.default_model]
        except KeyError:
            raise ModelNotFound(f"no model named {model!r}; hosted: {sorted(self.workers)}") from None

    def _decode_batch(self, request) -> tuple[ModelWorker, list[DecodeInput], LogitsPolicy]:
        """BatchDecode / DecodeSession request -> its model's worker, the items and the policy."""
        first = request.items[0].kv_cache.model if request.items else ""
        items = [DecodeInput(i.token_id, _required_handle(i)) for i in request.items]
        return self._worker(request.model or first), items, convert.policy_from_proto(request.logits)

    @staticmethod
    def _result(message, out, received_ns: int):
        """Fills a reply's logits, handle and timing in place (large logits are copied once)."""
        convert.fill_logits(message.logits, out.logits)
        message.kv_cache.CopyFrom(convert.handle_to_proto(out.kv_cache))
        message.timing.CopyFrom(convert.timing_to_proto(out.timing))
        message.timing.total_ns = time.perf_counter_ns() - received_ns
        return message

    # -- queries -----------------------------------------------------------------
    @_query
    async def GetModelInfo(self, request, context):
        return convert.model_info_to_proto(self._worker(request.model).executor.info())

    @_query
    async def GetCapabilities(self, request, context):
        caps = convert.capabilities_to_proto(self._worker(request.model).executor.capabilities())
        caps.models.extend(sorted(self.workers))
        return caps

    @_query
    async def GetStatus(self, request, context):
        if self.state is ServerState.LOADING and not self.workers:
            return pb.Status(state=pb.Status.STATE_LOADING, server_instance_id=self.instance_id)
        worker = self._worker(request.model)
        status = await worker.call(worker.executor.status, self.state, worker.queue_depth)
        return convert.status_to_proto(status)

    # -- the contract ----------------------------------------------------------------
    @_rpc
    async def Prefill(self, request, context):
        received = time.perf_counter_ns()
        worker = self._worker(request.model or request.kv_cache.model)
        handle = convert.handle_from_proto(request.kv_cache) if request.HasField("kv_cache") else None
        out = await worker.prefill(list(request.token_ids), handle, convert.policy_from_proto(request.logits))
        return self._result(pb.PrefillResponse(cached_tokens=out.cached_tokens), out, received)

    @_rpc
    async def Decode(self, request, context):
        received = time.perf_counter_ns()
        worker = self._worker(request.model or request.kv_cache.model)
        item = DecodeInput(request.token_id, _required_handle(request))
        (out,) = await worker.decode([item], convert.policy_from_proto(request.logits))
        return self._result(pb.DecodeResponse(), out, received)

    @_rpc
    async def BatchDecode(self, request, context):
        received = time.perf_counter_ns()
        worker, items, policy = self._decode_batch(request)
        outs = await worker.decode(items, policy)
        for index, out in enumerate(outs):
            yield self._result(pb.BatchDecodeResponse(index=index), out, received)

    @_rpc
    async def ForwardVerify(self, request, context):
        received = time.perf_counter_ns()
        worker = self._worker(request.model or request.kv_cache.model)
        out = await worker.call(worker.executor.forward_verify, list(request.token_ids),
                                _required_handle(request),
                                convert.policy_from_proto(request.logits))
        return self._result(pb.ForwardVerifyResponse(), out, received)

    @_rpc
    async def TruncateKv(self, request, context):
        worker = self._worker(request.kv_cache.model)
        handle = await worker.call(worker.executor.truncate_kv, _required_handle(request),
                                   request.new_length)
        return pb.TruncateKvResponse(kv_cache=convert.handle_to_proto(handle))

    @_rpc
    async def ReleaseCache(self, request, context):
        worker = self._worker(request.model)
        freed = await worker.call(worker.executor.release_cache, request.cache_id)
        return pb.ReleaseCacheResponse(blocks_freed=freed)

    @_rpc
    async def ForkCache(self, request, context):
        worker = self._worker(request.kv_cache.model)
        children = await worker.call(worker.executor.fork_cache, _required_handle(request), request.num_children)
        return pb.ForkCacheResponse(children=[convert.handle_to_proto(c) for c in children])

    async def DecodeSession(self, request_iterator, context):
        """Steps run as they arrive (steps on different sequences may be in flight
        together and share forwards); replies go out as steps finish.  A failed
        step answers with its error and the session goes on."""
        replies: asyncio.Queue = asyncio.Queue()
        steps: set[asyncio.Task] = set()

        async def run_step(request) -> None:
            received = time.perf_counter_ns()
            try:
                with self._admit():
                    worker, items, policy = self._decode_batch(request)
                    outs = await worker.decode(items, policy)
            except Exception as exc:
                await replies.put(pb.DecodeSessionResponse(step_id=request.step_id, error=to_status_proto(_as_executor_error(exc))))
                return
            for index, out in enumerate(outs):
                await replies.put(self._result(pb.DecodeSessionResponse(step_id=request.step_id, index=index),
                                               out, received))

        async def read_all() -> None:
            async for request in request_iterator:
                task = asyncio.create_task(run_step(request))
                steps.add(task)
                task.add_done_callback(steps.discard)
            if steps:
                await asyncio.gather(*steps)
            await replies.put(None)

        reader = asyncio.create_task(read_all())
        try:
            while (reply := await replies.get()) is not None:
                yield reply
            await reader  # surfaces a broken request stream
        finally:
            reader.cancel()

    async def Forward(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED,
                            "Forward is not implemented: use Prefill/Decode (the executor trait's default)")
