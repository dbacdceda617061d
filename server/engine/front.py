"""The model worker's asyncio front: each call a coroutine that submits its job and
awaits it; a cancelled await (gRPC cancels a handler whose caller cancelled,
disconnected or ran out of time) stops the job and undoes what it did, and a
result that arrives after its caller's deadline is undone too.  Decoding ahead
starts a run the worker drives instead (``runs.py``)."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future
from typing import Any, Callable

from ferrum_rpc.types import DecodeInput, KvCacheHandle, LogitsPolicy, VerifyOutput
from .undo import Undo
from .executor import verify_policy
from .jobs import DecodeWork, Done, Job


class AsyncFront:
    """The awaitable calls of one :class:`~.worker.ModelWorker` (``worker.front``): each
    puts a job on the worker's queue and awaits it; the worker's thread runs it."""

    def __init__(self, worker):
        self.worker = worker

    async def prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None, policy: LogitsPolicy | None,
                      deadline: float | None = None, hidden=None, tenant: str = "", choice=None,
                      as_output: bool = False, name: str = "", adapter: str = "") -> Done:
        """A prompt; ``choice`` (a TokenChoice): also the token after it, chosen on this
        thread right after the forward; ``policy=None``: the logits field was unset;
        ``name``: the caller's request_id for the new sequence; ``adapter``: its LoRA adapter."""
        job = self.worker.put(self.worker.prefill_job(token_ids, kv_cache, policy, deadline, tenant, hidden, choice, as_output,
                                          name, adapter))
        return await self._await(job, lambda out: [Undo.of(kv_cache, out.kv_cache)])

    async def verify(self, token_ids: list[int], kv_cache: KvCacheHandle, policy: LogitsPolicy,
                     deadline: float | None = None, tenant: str = "") -> Done:
        """ForwardVerify: a continued prefill over every position (chunked when long,
        batched with other prompts when short)."""
        out, undo = await self.prefill(token_ids, kv_cache, verify_policy(policy), deadline, tenant=tenant,
                                       as_output=True)
        return Done(VerifyOutput(out.logits, out.kv_cache, out.timing), undo)

    async def decode(self, inputs: list[DecodeInput], policy: LogitsPolicy, deadline: float | None = None,
                     tenant: str = "") -> Done:
        """A decode step; the undo records are one per input, in order."""
        work = DecodeWork(inputs, policy)
        return await self._await(self.worker.put(Job(None, (), decode=work, deadline=deadline, tenant=tenant)), work.undo_records)

    async def speculative(self, token_id: int, draft: list[int], kv_cache: KvCacheHandle,
                          policy: LogitsPolicy | None, deadline: float | None = None, sampling=None,
                          tenant: str = "", choice=None) -> Done:
        """SpeculativeDecode: verify, accept (by ``choice``, a TokenChoice, when given) and
        truncate as one job."""
        job = self.worker.put(Job(self.worker.executor.speculative_decode,
                             (token_id, draft, kv_cache, policy, sampling, tenant, choice),
                             deadline=deadline, tenant=tenant))
        return await self._await(job, lambda out: [Undo.of(kv_cache, out.kv_cache)])

    async def fork(self, kv_cache: KvCacheHandle, num_children: int, deadline: float | None = None,
                   tenant: str = "") -> Done:
        job = self.worker.put(Job(self.worker.executor.fork_cache, (kv_cache, num_children, tenant), deadline=deadline,
                             tenant=tenant))
        return await self._await(job, lambda children: [Undo.of(None, c) for c in children])

    async def release_named(self, name: str, tenant: str = "") -> int:
        """ReleaseCache by request_id: aborts a prompt still creating that sequence, then
        releases it (see :meth:`TorchExecutor.release_named`)."""
        return await self.call(self.worker.release_named, name, tenant)

    async def create(self, fn: Callable[..., KvCacheHandle], *args: Any, deadline: float | None = None,
                     tenant: str = "") -> Done:
        """A call that makes one new sequence and returns its handle (ImportSequence):
        released again if its caller went away."""
        job = self.worker.put(Job(fn, args, deadline=deadline, tenant=tenant))
        return await self._await(job, lambda handle: [Undo.of(None, handle)])

    async def call(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Any:
        return await self._await(self.worker.put(Job(fn, args, deadline=deadline)))

    async def _await(self, job: Job, undo: Callable[[Any], list[Undo]] | None = None) -> Any:
        """Waits for a job; given ``undo`` (what builds its result's records), returns
        :class:`Done`, the result with those records.  If the waiting coroutine is
        cancelled (gRPC cancels a handler whose caller cancelled, disconnected or ran
        out of time), a queued
        job is dropped, a running prompt is stopped before its next part and undone, and
        one that finished anyway has its records (``undo(result)``, see ``Undo``)
        applied, so a reply nobody receives leaves no sequence behind."""
        try:
            result = await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.abandoned = True
            if undo is not None:
                job.future.add_done_callback(lambda f: self._undo_if_done(f, undo))
            raise
        if undo is not None and (gone := job.gone()) is not None:
            # Finished, but its caller's deadline passed before the reply could go back (a
            # stalled process resumed, say): the caller was told DEADLINE_EXCEEDED, so the
            # call must change nothing.  The undo is queued ahead of the caller's retry.
            self.worker.undo(undo(result), "a call answered after its deadline")
            raise gone
        return result if undo is None else Done(result, undo(result))

    def _undo_if_done(self, future: Future, undo: Callable[[Any], list[Undo]]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # nothing was done, or it was undone already
        self.worker.undo(undo(future.result()), "a finished call whose caller went away")
