"""One DecodeSession call: steps as they arrive, replies as steps finish, decoding ahead.

The servicer's ``DecodeSession`` handler makes one :class:`DecodeSession` per
call and awaits :meth:`DecodeSession.serve`; the admission, batching and reply
building it shares with the unary calls stay the servicer's.

Steps run as they arrive (steps on different sequences may be in flight
together and share forwards); replies go out as steps finish.  A failed step
answers with its error and the session goes on.

Back-pressure: at most ``MAX_PENDING_STEPS`` steps may have replies the caller
has not taken; past that the server stops reading requests, and gRPC's flow
control holds the caller.  A caller that goes away has its running steps
cancelled (and undone).

A step's result is confirmed when the caller's next step names its sequence at
the new length, or when the session ends cleanly (the caller half-closes and
reads to the end).  A session that ends otherwise (cancelled, deadline,
disconnect) undoes its unconfirmed steps, at most the last step of each
sequence, unless another call moved that sequence on meanwhile: a cancelled
call changes no state.

A step with ``max_new_tokens`` decodes ahead: up to that many forwards on the
server, each chosen token streamed as it comes (one message per forward for all
of the step's sequences, or per ``forwards_per_response`` forwards for a caller
that asks for fewer messages), until a stop token, the length, a ``stop`` message
naming its ``step_id``, or the model's maximum sequence length.

The run itself is the engine's (``engine/ahead.py``): the worker decodes its
sequences forward after forward without a round trip through the event loop, and
queues what each forward chose; this module takes those entries off the run's
bounded queue and sends them.  What a run can see of its caller's reading, and so
its pause: gRPC completes ``context.write`` once the reply's bytes fit the caller's
HTTP/2 receive window (stream and connection), not when the caller's code reads
them; a caller's transport reopens the window as the caller reads.  The session
takes a run's next entry only once its last reply's write completed, so a caller
that stops reading leaves the run's queue full and the run paused (it runs no
forward and grows no KV): the caller holds at most its window's worth of replies
plus the queue's bound of forwards per run (two, or a message's forwards and one
more with ``forwards_per_response``).  The window is the caller's to choose:
64 KiB unless it says otherwise (a raw HTTP/2 peer, or gRPC with BDP probing off),
about 4 MiB once gRPC's BDP probing has grown it on a fast link (measured on
loopback), and up to the socket buffers (~3 MB measured) for a peer that announces
2^31-1.  What one tenant can make the server hold meanwhile is bounded apart from
the window: its sequences decoding ahead (``ModelWorker.start_ahead``'s seats) and
its KV (``ExecutorConfig.tenant_kv_tokens``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from ferrum_rpc import convert
from ferrum_rpc.errors import InvalidInput, to_status_proto
from ..engine.facade import QUEUED_FORWARDS, AheadRun, Emitted, Finish, ModelWorker
from .ledger import Undelivered
from .handler import as_executor_error, check_parsed
from ferrum_rpc.rules import check_decode_session
from ferrum_rpc.types import DecodeInput
from ferrum_rpc.v1 import executor_pb2 as pb

MAX_PENDING_STEPS = 8  # steps whose replies the caller has not taken yet
SESSION_END_GRACE_S = 0.02  # a session whose requests ended waits this long for a cancel sent after them
MAX_HELD_TOKENS = 1024  # a decode-ahead response holds no more forwards once it holds this many tokens

_STEP_DONE = object()  # a step's last entry in the reply queue: frees its window seat


class DecodeSession:
    """The state of one call: the reply queue, the undo ledger, the running steps."""

    def __init__(self, servicer, context, tenant: str, deadline: float | None):
        self.servicer, self.context, self.tenant, self.deadline = servicer, context, tenant, deadline
        self.replies: asyncio.Queue = asyncio.Queue()  # (reply, its size in bytes)
        self.unsent = 0  # bytes of replies queued or being written: not yet in the caller's window
        self.ledger = Undelivered()  # steps' results until their replies are handed to gRPC
        self.window = asyncio.Semaphore(MAX_PENDING_STEPS)
        self.steps: set[asyncio.Task] = set()
        self.ahead: dict[int, AheadRun] = {}  # running decode-ahead steps by step_id

    async def serve(self, request_iterator) -> None:
        reader = asyncio.create_task(self._read_all(request_iterator))
        self.servicer.sessions.add(self)  # GetStatus sums their unsent bytes
        try:
            while (entry := await self.replies.get()) is not None:
                if entry is _STEP_DONE:
                    self.window.release()
                else:
                    await self.context.write(entry[0])  # not yielded: see servicer._rpc's docstring
                    self.unsent -= entry[1]
                    if entry[2] is not None and not entry[2].done():
                        entry[2].set_result(None)
            await reader  # surfaces a broken request stream
            # gRPC ends the request stream the same way for a half-close and a cancel (an
            # RST_STREAM): the cancel shows as this task being cancelled a moment later
            await asyncio.sleep(SESSION_END_GRACE_S)
        except BaseException:
            self.ledger.abandon_rest()  # unconfirmed steps (see the module docstring)
            raise
        else:
            self.ledger.keep()
        finally:
            self.servicer.sessions.discard(self)
            reader.cancel()
            for task in list(self.steps):
                task.cancel()  # a step still at the worker undoes itself (ModelWorker._await)

    async def _hand(self, reply, written: asyncio.Future | None = None) -> None:
        """Queues ``reply`` for the caller, counted as unsent until gRPC took it; ``written``
        resolves once it did."""
        size = len(reply) if isinstance(reply, bytes) else reply.ByteSize()  # large replies come serialized
        self.unsent += size
        await self.replies.put((reply, size, written))

    async def _read_all(self, request_iterator) -> None:
        requests = request_iterator.__aiter__()
        while True:
            await self.window.acquire()  # released once a step's replies were all taken
            try:
                request = await requests.__anext__()
            except StopAsyncIteration:
                break
            task = asyncio.create_task(self._run_step(request))
            self.steps.add(task)
            task.add_done_callback(self.steps.discard)
        if self.steps:
            await asyncio.gather(*self.steps)
        await self.replies.put(None)

    async def _run_step(self, request) -> None:
        servicer, ledger, tenant = self.servicer, self.ledger, self.tenant
        received = time.perf_counter_ns()
        step_id = getattr(request, "step_id", 0)
        keys: list[int] = []
        try:
            check_parsed(request)
            if request.stop:
                check_decode_session(request)
                if step_id in self.ahead:
                    self.ahead[step_id].stop()
                return
            with contextlib.ExitStack() as pinned:  # a shared-memory region stays mapped to the end
                with servicer.admit():
                    worker, items, policy = servicer.decode_batch(request)
                    ledger.confirm([i.kv_cache for i in items])  # the caller read those replies
                    check_decode_session(request, worker.executor.limits)
                    if request.max_new_tokens:
                        outs = await self._decode_ahead(request, worker, items, keys)
                    else:
                        targets = pinned.enter_context(
                            servicer.replies.logits_targets(policy, [1] * len(items), worker, tenant))
                        outs, undo = await worker.front.decode(items, policy, self.deadline, tenant)
                        keys = servicer.replies.register_decodes(ledger, worker, undo)  # no await since the decode
                if not request.max_new_tokens:
                    async for _, reply in servicer.replies.step_replies(pb.DecodeSessionResponse, {"step_id": step_id},
                                                                 outs, received, request.single_reply, targets, keys):
                        await self._hand(reply)
            servicer.observe("DecodeSession", tenant, None, received / 1e9, outs[0].timing if outs else None)
        except Exception as exc:
            ledger.abandon(keys)  # the step answers with an error: it changes nothing
            servicer.observe("DecodeSession", tenant, exc, received / 1e9)
            await self._hand(pb.DecodeSessionResponse(
                step_id=step_id, error=to_status_proto(as_executor_error(exc))))
        finally:
            await self.replies.put(_STEP_DONE)

    async def _decode_ahead(self, request, worker: ModelWorker, items: list[DecodeInput], keys: list[int]) -> list:
        """Starts a run on the worker (``engine/ahead.py``) and streams what its forwards
        chose, one message per forward (or per ``forwards_per_response`` forwards, queued
        by the run meanwhile: its queue's bound is that many and one more), taking the
        next forwards' tokens only once the last reply went into the caller's window.  When
        the run's last entry is taken, ``keys`` gets its ledger entries (each sequence
        from where the run found it to where it left it: undone if its reply is never
        sent).  Returns each item's last output."""
        step_id = request.step_id
        if step_id in self.ahead:  # a stop message must name one run
            raise InvalidInput(f"step_id {step_id} names a decode-ahead step still running")
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        per_response = max(1, min(request.forwards_per_response, MAX_HELD_TOKENS // len(items)))
        # the run's queue holds a message's forwards and one more (run while that message is
        # written); start_ahead refuses past the tenant's share of seats
        run = worker.start_ahead(items, request.max_new_tokens, frozenset(request.stop_token_ids), self.tenant,
                                 self.deadline, max(QUEUED_FORWARDS, per_response + 1))

        def on_entry() -> None:  # worker thread: wakes this task once per message, not per forward
            if run.queued >= per_response or not run.running:
                loop.call_soon_threadsafe(ready.set)

        run.on_entry = on_entry
        self.ahead[step_id] = run
        try:
            while not run.done:
                ready.clear()
                if run.running and run.queued < per_response:
                    await ready.wait()
                    continue
                entries = run.take_some(per_response)  # raises the run's error (the run was undone)
                if not entries:  # not expected (a run stops running with an entry queued, or fails)
                    await ready.wait()
                    continue
                if run.done:  # the last entry: the run's results are this call's now
                    keys.extend(self.ledger.add(worker, [undo]) for undo in run.undo_records())
                written = loop.create_future()
                await self._hand(_ahead_reply(step_id, [e for entry in entries for e in entry]), written)
                await written  # in the caller's window: the next forwards may go
        except BaseException:
            run.cancel()  # a running run is ended and undone by the worker
            raise
        finally:
            self.ahead.pop(step_id, None)
        return run.last


_FINISH = {Finish.STOP_TOKEN: pb.FINISH_REASON_STOP_TOKEN, Finish.LENGTH: pb.FINISH_REASON_LENGTH,
           Finish.STOPPED: pb.FINISH_REASON_STOPPED, Finish.MAX_SEQUENCE_LENGTH: pb.FINISH_REASON_MAX_SEQUENCE_LENGTH}


def _ahead_reply(step_id: int, entry: list[Emitted]) -> pb.DecodeSessionResponse:
    """One or more forwards of a run as one message (each message costs the server a socket
    write and the caller a read): a result per sequence and forward, in order, with its
    handle and timing once it finished."""
    results = []
    for emitted in entry:
        result = pb.DecodeSessionResponse(step_id=step_id, index=emitted.index)
        result.chosen.CopyFrom(convert.chosen_to_proto(emitted.out.chosen))
        if emitted.finish is not None:
            result.finish_reason = _FINISH[emitted.finish]
            result.kv_cache.CopyFrom(convert.handle_to_proto(emitted.out.kv_cache))
            result.timing.CopyFrom(convert.timing_to_proto(emitted.out.timing))
        results.append(result)
    return results[0] if len(results) == 1 else pb.DecodeSessionResponse(step_id=step_id, results=results)
