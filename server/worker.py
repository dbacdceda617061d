"""One model worker thread per executor: every forward and every KV change runs here.

The thread also loads the model: all of an executor's torch work happens on
this one thread.  That is a correctness-of-speed matter, not style: libgomp
throttles its spin-waiting once more OpenMP threads exist than cores, and a
second thread that ever ran a parallel op (the loader, say) keeps its team
alive, making every small decode op pay a futex wake-up (2x slower steps on
a 2-core machine).

Callers (the gRPC event loop, or plain threads) submit jobs and get futures, so
the event loop never blocks on torch.  Decode jobs waiting in the queue are
coalesced into one batched forward (dynamic batching): while a forward runs,
new decodes pile up and the next forward takes them all, up to the max batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator

from ferrum_rpc.errors import Cancelled, DeadlineExceeded, Draining, ExecutorError
from ferrum_rpc.server.auth import current_tenant
from ferrum_rpc.server.executor import TorchExecutor, verify_policy
from ferrum_rpc.types import DecodeInput, KvCacheHandle, LogitsPolicy, VerifyOutput

log = logging.getLogger(__name__)


@dataclass
class _Job:
    fn: Callable[..., Any] | None
    args: tuple
    future: Future = field(default_factory=Future)
    enqueued_ns: int = field(default_factory=time.perf_counter_ns)
    decode: tuple[list[DecodeInput], LogitsPolicy] | None = None
    prefill: tuple[list[int], KvCacheHandle | None, LogitsPolicy] | None = None  # fits one forward
    sliced: bool = False  # fn returns a generator run one slice at a time
    steps: Generator | None = None
    queue_ns: int = 0
    deadline: float | None = None  # time.monotonic() past which the caller no longer waits
    abandoned: bool = False  # the caller went away: stop at the next slice and undo
    tenant: str = field(default_factory=current_tenant.get)  # who submitted it (see auth.py)

    @contextlib.contextmanager
    def as_tenant(self):
        """Runs the job's executor calls as its submitter's tenant (on the worker thread)."""
        token = current_tenant.set(self.tenant)
        try:
            yield
        finally:
            current_tenant.reset(token)

    def gone(self) -> ExecutorError | None:
        """Why this job's caller no longer waits for it, or None while it does."""
        if self.abandoned:
            return Cancelled("the caller cancelled the call")
        if self.deadline is not None and time.monotonic() > self.deadline:
            return DeadlineExceeded("the caller's deadline passed; the work was undone")
        return None


class ModelWorker:
    """Serialises access to one executor on a dedicated thread.

    Args:
        load: builds the executor; runs on the worker thread (see the module docstring).
        name: names the thread.
        batch_wait_ms: after taking a decode, wait this long for more to batch.
    """

    REAP_EVERY_S = 1.0

    def __init__(self, load: Callable[[], TorchExecutor], name: str = "model", batch_wait_ms: float = 0.0):
        self.executor: TorchExecutor | None = None
        self.batch_wait_s = batch_wait_ms / 1000
        self._next_reap = time.monotonic() + self.REAP_EVERY_S
        self._jobs: deque[_Job | None] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self.loaded: Future = Future()  # resolves to the executor once the thread has built it
        self._thread = threading.Thread(target=self._main, args=(load,), name=f"model-worker[{name}]",
                                        daemon=True)
        self._thread.start()

    async def started(self) -> TorchExecutor:
        return await asyncio.wrap_future(self.loaded)

    def _main(self, load: Callable[[], TorchExecutor]) -> None:
        try:
            self.executor = load()
        except BaseException as exc:
            self.loaded.set_exception(exc)
            return
        self.loaded.set_result(self.executor)
        self._loop()

    @property
    def queue_depth(self) -> int:
        return len(self._jobs)

    def submit(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Future:
        """Runs ``fn(*args)`` on the worker thread."""
        return self._put(_Job(fn, args, deadline=deadline)).future

    def submit_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                       policy: LogitsPolicy, deadline: float | None = None) -> Future:
        """A prompt within one chunk may share a padded forward with other callers'
        prompts; a longer one runs as a sliced job, in chunks between other jobs
        (queued decodes run in between, so a long prefill never stalls other
        callers).  A caller that went away, or whose deadline passed, has the
        sliced job stopped at the next chunk, which undoes its work."""
        return self._put(self._prefill_job(token_ids, kv_cache, policy, deadline)).future

    def _prefill_job(self, token_ids, kv_cache, policy, deadline, hidden=None) -> _Job:
        if len(token_ids) > self.executor.config.prefill_chunk or hidden is not None:  # analysis: its own forwards
            return _Job(self.executor.prefill_chunks, (token_ids, kv_cache, policy, hidden), sliced=True,
                        deadline=deadline)
        return _Job(None, (), prefill=(token_ids, kv_cache, policy), deadline=deadline)

    # -- asyncio front: a cancelled await stops the job and undoes what it did ------
    async def call(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Any:
        return await self._await(self._put(_Job(fn, args, deadline=deadline)))

    async def prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None, policy: LogitsPolicy,
                      deadline: float | None = None, hidden=None) -> Any:
        origin = kv_cache.sequence_length if kv_cache is not None else None
        job = self._put(self._prefill_job(token_ids, kv_cache, policy, deadline, hidden))
        return await self._await(job, lambda out: [(out.kv_cache.cache_id, origin)])

    async def verify(self, token_ids: list[int], kv_cache: KvCacheHandle, policy: LogitsPolicy,
                     deadline: float | None = None) -> VerifyOutput:
        """ForwardVerify: a continued prefill over every position (chunked when long,
        batched with other prompts when short)."""
        out = await self.prefill(token_ids, kv_cache, verify_policy(policy), deadline)
        return VerifyOutput(out.logits, out.kv_cache, out.timing)

    async def decode(self, inputs: list[DecodeInput], policy: LogitsPolicy, deadline: float | None = None) -> list:
        job = self._put(_Job(None, (), decode=(inputs, policy), deadline=deadline))
        return await self._await(job, lambda _: [(i.kv_cache.cache_id, i.kv_cache.sequence_length)
                                                 for i in inputs])

    async def speculative(self, token_id: int, draft: list[int], kv_cache: KvCacheHandle, policy: LogitsPolicy,
                          deadline: float | None = None, sampling=None) -> Any:
        """SpeculativeDecode: verify, accept and truncate as one job."""
        job = self._put(_Job(self.executor.speculative_decode, (token_id, draft, kv_cache, policy, sampling),
                             deadline=deadline))
        return await self._await(job, lambda _: [(kv_cache.cache_id, kv_cache.sequence_length)])

    async def fork(self, kv_cache: KvCacheHandle, num_children: int, deadline: float | None = None) -> list:
        job = self._put(_Job(self.executor.fork_cache, (kv_cache, num_children), deadline=deadline))
        return await self._await(job, lambda children: [(c.cache_id, None) for c in children])

    async def _await(self, job: _Job, undo: Callable[[Any], list[tuple[str, int | None]]] | None = None) -> Any:
        """Waits for a job.  If the waiting coroutine is cancelled (gRPC cancels a
        handler whose caller cancelled, disconnected or ran out of time), a queued
        job is dropped, a running one is stopped at its next slice and undone, and
        one that finished anyway has its changes (``undo(result)``) put back, so a
        reply nobody receives leaves no sequence behind."""
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            job.abandoned = True
            if undo is not None:
                job.future.add_done_callback(lambda f: self._undo_if_done(f, undo))
            raise

    def _undo_if_done(self, future: Future, undo: Callable[[Any], list]) -> None:
        if future.cancelled() or future.exception() is not None:
            return  # nothing was done, or it was undone already
        changes = undo(future.result())
        log.info("undoing a finished call whose caller went away (%d sequence(s))", len(changes))
        self.submit(self.executor.undo_calls, changes)  # refused while stopping: they go with it

    def stop(self, timeout: float | None = None) -> None:
        """Refuses new jobs, finishes every queued one (sliced jobs included), then
        ends the thread.  No future is left unresolved."""
        with self._cond:
            self._stopping = True
            self._jobs.append(None)
            self._cond.notify()
        self._thread.join(timeout)

    def _put(self, job: _Job) -> _Job:
        with self._cond:
            if self._stopping:
                job.future.set_exception(Draining("the model worker is stopping"))
                return job
            self._jobs.append(job)
            self._cond.notify()
        return job

    def _requeue(self, job: _Job) -> None:
        """Puts a sliced job back at the end of the queue (also after a stop: it finishes)."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    # -- the worker thread --------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._reap()
                    self._cond.wait(self.REAP_EVERY_S)
                job = self._jobs.popleft()
                if job is None:
                    if not self._jobs:
                        return
                    self._jobs.append(None)  # sliced jobs re-queued behind the stop finish first
                    continue
                batch = [job]
                if job.decode:
                    self._collect(batch)
                elif job.prefill:
                    batch += self._collect_prefills(job)
            self._reap()
            if job.decode:
                if self.batch_wait_s:
                    self._wait_for_more(batch)
                self._run_decodes(batch)
            elif job.prefill:
                self._run_prefills(batch)
            elif job.sliced:
                self._run_slice(job)
            else:
                self._run(job)

    def _fits(self, batch: list[_Job], job: _Job) -> bool:
        """A decode job may join a forward if it adds no sequence twice and stays in the max batch."""
        ids = [i.kv_cache.cache_id for i in job.decode[0]]
        seen = {i.kv_cache.cache_id for j in batch for i in j.decode[0]}
        size = sum(len(j.decode[0]) for j in batch)
        return size + len(ids) <= self.executor.config.max_batch_size and seen.isdisjoint(ids)

    def _collect(self, batch: list[_Job]) -> bool:
        """Moves queued decodes into ``batch`` while they fit (lock held), fairly
        across tenants.

        Only the run of decodes at the head of the queue is considered (a job that
        is not a decode ends it, so one caller's calls stay in order).  Within it,
        jobs are taken round-robin by tenant, the tenant with the fewest jobs in the
        batch first, each tenant's in arrival order: a tenant that floods the queue
        gets its share of each forward, never all of it, while another tenant's
        decode waits.  Returns True if the batch is closed (full, a job that does
        not fit, or a non-decode job is next).
        """
        cap = self.executor.config.max_batch_size
        size = sum(len(j.decode[0]) for j in batch)
        if size >= cap:
            return True
        run: list[_Job] = []
        for job in self._jobs:
            if job is None or not job.decode:
                break
            run.append(job)
        closed = len(run) < len(self._jobs)
        by_tenant: dict[str, deque[_Job]] = {}
        for job in run:
            by_tenant.setdefault(job.tenant, deque()).append(job)
        in_batch = {t: sum(1 for j in batch if j.tenant == t) for t in by_tenant}
        taken: set[int] = set()
        while size < cap:
            ready = [t for t, q in by_tenant.items() if q]
            if not ready:
                break
            tenant = min(ready, key=lambda t: in_batch[t])  # ties: the earliest arrival
            job = by_tenant[tenant][0]
            if not self._fits(batch, job):
                del by_tenant[tenant]  # its later jobs wait behind this one
                closed = True
                continue
            by_tenant[tenant].popleft()
            batch.append(job)
            taken.add(id(job))
            in_batch[tenant] += 1
            size += len(job.decode[0])
        if taken:
            kept = [j for j in self._jobs if id(j) not in taken]
            self._jobs.clear()
            self._jobs.extend(kept)
        return closed or size >= cap or any(by_tenant.values())

    def _collect_prefills(self, first: _Job) -> list[_Job]:
        """Prefills queued right behind ``first`` that can share its forward (lock held).

        Bounded by the max batch size and a padded size of two prefill chunks;
        a sequence never appears twice.
        """
        taken: list[_Job] = []
        longest, seen = len(first.prefill[0]), {first.prefill[1].cache_id} if first.prefill[1] else set()
        budget = 2 * self.executor.config.prefill_chunk
        while self._jobs and self._jobs[0] is not None and self._jobs[0].prefill:
            tokens, handle, _ = self._jobs[0].prefill
            width = max(longest, len(tokens))
            if (len(taken) + 2 > self.executor.config.max_batch_size or width * (len(taken) + 2) > budget
                    or (handle is not None and handle.cache_id in seen)):
                break
            taken.append(self._jobs.popleft())
            longest = width
            if handle is not None:
                seen.add(handle.cache_id)
        return taken

    def _run_prefills(self, batch: list[_Job]) -> None:
        self._run_planned(batch, lambda job: self.executor.plan_prefill(*job.prefill), self.executor.run)

    def _wait_for_more(self, batch: list[_Job]) -> None:
        deadline = time.monotonic() + self.batch_wait_s
        with self._cond:
            while not self._collect(batch) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def _reap(self) -> None:
        now = time.monotonic()
        if now >= self._next_reap:
            self._next_reap = now + self.REAP_EVERY_S
            try:
                self.executor.expire_idle()
            except Exception:  # bookkeeping must never kill the worker
                log.exception("idle reclamation failed")

    def _run_slice(self, job: _Job) -> None:
        """Advances a sliced job by one slice; requeues it if it is not finished.
        A job whose caller went away is stopped instead: its generator undoes its work."""
        if job.steps is None:
            if not job.future.set_running_or_notify_cancel():
                return
            if (gone := job.gone()) is not None:
                job.future.set_exception(gone)
                return
            job.queue_ns = time.perf_counter_ns() - job.enqueued_ns
            try:
                with job.as_tenant():
                    job.steps = job.fn(*job.args)
            except BaseException as exc:
                job.future.set_exception(exc)
                return
        try:
            with job.as_tenant():
                if (gone := job.gone()) is not None:
                    job.steps.throw(gone)  # the generator rolls back what it did and re-raises
                next(job.steps)
        except StopIteration as done:
            job.future.set_result(_with_queue_time(done.value, job.queue_ns))
        except BaseException as exc:
            job.future.set_exception(exc)
        else:
            self._requeue(job)

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        if (gone := job.gone()) is not None:
            job.future.set_exception(gone)
            return
        queue_ns = time.perf_counter_ns() - job.enqueued_ns
        try:
            with job.as_tenant():
                result = job.fn(*job.args)
        except BaseException as exc:  # handed to the caller, never lost
            job.future.set_exception(exc)
            return
        job.future.set_result(_with_queue_time(result, queue_ns))

    def _run_decodes(self, batch: list[_Job]) -> None:
        self._run_planned(batch, lambda job: self.executor.plan_decode(*job.decode), self.executor.run)

    def _run_planned(self, batch: list[_Job], plan: Callable[[_Job], Any], run: Callable[[list], list]) -> None:
        """Plans every job (a job whose plan fails gets its error alone), then runs
        all plans in one forward and hands each job its result."""
        start = time.perf_counter_ns()
        planned: list[tuple[_Job, Any]] = []
        for job in batch:
            if not job.future.set_running_or_notify_cancel():
                continue
            if (gone := job.gone()) is not None:  # nobody waits for it: do not run it
                job.future.set_exception(gone)
                continue
            try:
                with job.as_tenant():
                    planned.append((job, plan(job)))
            except BaseException as exc:
                job.future.set_exception(exc)
        if not planned:
            return
        try:
            results = run([p for _, p in planned])
        except BaseException as exc:
            if not isinstance(exc, ExecutorError):
                log.exception("batched forward failed")
            for job, _ in planned:
                job.future.set_exception(exc)
            return
        for (job, _), result in zip(planned, results):
            job.future.set_result(_with_queue_time(result, start - job.enqueued_ns))


def _with_queue_time(result: Any, queue_ns: int) -> Any:
    """Stamps the queue time on an output (or a list of them); other results pass through."""
    if isinstance(result, list):
        return [_with_queue_time(r, queue_ns) for r in result]
    if hasattr(result, "timing"):
        return replace(result, timing=replace(result.timing, queue_ns=queue_ns))
    return result
