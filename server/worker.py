"""One model worker thread per executor: every forward and every KV change runs here.

Callers (the gRPC event loop, or plain threads) submit jobs and get futures, so
the event loop never blocks on torch.  Decode jobs waiting in the queue are
coalesced into one batched forward (dynamic batching): while a forward runs,
new decodes pile up and the next forward takes them all, up to the max batch.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.server.executor import TorchExecutor
from ferrum_rpc.types import DecodeInput, LogitsPolicy

log = logging.getLogger(__name__)


@dataclass
class _Job:
    fn: Callable[..., Any] | None
    args: tuple
    future: Future = field(default_factory=Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    decode: tuple[list[DecodeInput], LogitsPolicy] | None = None


class ModelWorker:
    """Serialises access to one executor on a dedicated thread.

    Args:
        executor: the executor it owns.
        batch_wait_ms: after taking a decode, wait this long for more to batch.
    """

    def __init__(self, executor: TorchExecutor, batch_wait_ms: float = 0.0):
        self.executor = executor
        self.batch_wait_s = batch_wait_ms / 1000
        self._jobs: deque[_Job | None] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"model-worker[{executor.name}]", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Runs ``fn(*args)`` on the worker thread."""
        return self._put(_Job(fn, args))

    def submit_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy) -> Future:
        """Queues a (batch) decode that may share a forward with other callers'."""
        return self._put(_Job(None, (), decode=(inputs, policy)))

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self.submit(fn, *args))

    async def decode(self, inputs: list[DecodeInput], policy: LogitsPolicy) -> list:
        return await asyncio.wrap_future(self.submit_decode(inputs, policy))

    def stop(self, timeout: float | None = None) -> None:
        """Finishes queued jobs, then ends the thread."""
        with self._cond:
            self._jobs.append(None)
            self._cond.notify()
        self._thread.join(timeout)

    def _put(self, job: _Job) -> Future:
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()
        return job.future

    # -- the worker thread --------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.popleft()
                if job is None:
                    return
                batch = [job] + self._take_decodes(job) if job.decode else None
            if batch is None:
                self._run(job)
            else:
                if self.batch_wait_s and self._batch_size(batch) < self.executor.config.max_batch_size:
                    batch += self._wait_for_more(batch)
                self._run_decodes(batch)

    @staticmethod
    def _batch_size(batch: list[_Job]) -> int:
        return sum(len(j.decode[0]) for j in batch)

    def _take_decodes(self, first: _Job, ) -> list[_Job]:
        """Pops the decodes queued right behind ``first`` that fit in its forward.

        Stops at the first non-decode job so one caller's calls stay in order.
        Called with the lock held.
        """
        taken: list[_Job] = []
        size = len(first.decode[0])
        seen = {i.kv_cache.cache_id for i in first.decode[0]}
        while self._jobs and self._jobs[0] is not None and self._jobs[0].decode:
            nxt = self._jobs[0]
            ids = {i.kv_cache.cache_id for i in nxt.decode[0]}
            if size + len(ids) > self.executor.config.max_batch_size or ids & seen:
                break
            taken.append(self._jobs.popleft())
            size += len(ids)
            seen |= ids
        return taken

    def _wait_for_more(self, batch: list[_Job]) -> list[_Job]:
        deadline = time.monotonic() + self.batch_wait_s
        more: list[_Job] = []
        with self._cond:
            while (left := deadline - time.monotonic()) > 0:
                if self._jobs and self._jobs[0] is not None and self._jobs[0].decode:
                    head = self._jobs.popleft()
                    more.append(head)
                    more += self._take_decodes(head)
                    break
                self._cond.wait(left)
        return more

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        queue_ns = time.perf_counter_ns() - job.enqueued_ns
        try:
            result = job.fn(*job.args)
        except BaseException as exc:  # handed to the caller, never lost
            job.future.set_exception(exc)
            return
        if hasattr(result, "timing"):
            result = replace(result, timing=replace(result.timing, queue_ns=queue_ns))
        job.future.set_result(result)

    def _run_decodes(self, batch: list[_Job]) -> None:
        start = time.perf_counter_ns()
        planned: list[tuple[_Job, Any]] = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                planned.append((job, self.executor.plan_decode(*job.decode)))
            except BaseException as exc:
                job.future.set_exception(exc)
        if not planned:
            return
        try:
            results = self.executor.run_decode([plan for _, plan in planned])
        except BaseException as exc:
            if not isinstance(exc, ExecutorError):
                log.exception("batched decode failed")
            for job, _ in planned:
                job.future.set_exception(exc)
            return
        for (job, _), outs in zip(planned, results):
            queue_ns = start - job.enqueued_ns
            job.future.set_result([replace(o, timing=replace(o.timing, queue_ns=queue_ns)) for o in outs])
