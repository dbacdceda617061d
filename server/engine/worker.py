"""One model worker thread per executor: every forward and every KV change runs here.

The thread also loads the model: all of an executor's torch work happens on this one
thread (libgomp throttles its spin-waiting once more OpenMP threads exist than cores,
and a second thread that ever ran a parallel op keeps its team alive: 2x slower
decode steps on a 2-core machine).

Callers submit jobs and get futures (``front.py`` awaits them for the event loop).
Decode jobs waiting in the queue are coalesced into one batched forward, up to the
max batch.  Prompts share those forwards (the unified forward, Ferrum's
``unified_forward``; vLLM and Sarathi-Serve schedule the same way): each forward
takes every waiting decode first, then fills the rest of a token budget
(``step_token_budget``) with the next parts of waiting prompts.  While callers are
decoding, a forward without decodes is held to the budget too, so their next calls
join the next forward instead of waiting out a whole prompt chunk; prompts still
progress every step (at least a quarter of the budget is theirs).  A forward of
decodes only stays a plain (B, 1) batch, the fastest decode path.

What shares a forward is decided by ``scheduler.py`` (pure functions over a
snapshot of the queue, unit-tested without a model); this module holds the
thread, the queue, the futures, cancellation and deadlines.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

from ferrum_rpc.errors import Draining, ExecutorError, RequestIdBusy
from ferrum_rpc.types import DecodeInput, KvCacheHandle, LogitsPolicy
from . import scheduler
from .undo import Undo
from .executor import TorchExecutor
from .front import AsyncFront
from .runs import DrivesRuns
from .jobs import DecodeWork, Job, PromptWork, with_queue_time

log = logging.getLogger(__name__)


class ModelWorker(DrivesRuns):
    """Serialises access to one executor on a dedicated thread.

    Args:
        load: builds the executor; runs on the worker thread (see the module docstring).
        name: names the thread.
        batch_wait_ms: after taking a decode, wait this long for more to batch.
    """

    REAP_EVERY_S = 1.0
    ADMISSION_WAIT_S = 2.0  # how long a prompt the pool cannot hold waits for other sequences to go
    PARKED_POLL_S = 0.02
    DECODERS_ACTIVE_S = 1.0  # a decode forward this recent means decoders are active (see _take_prompts)

    def __init__(self, load: Callable[[], TorchExecutor], name: str = "model", batch_wait_ms: float = 0.0):
        self.executor: TorchExecutor | None = None
        self.batch_wait_s = batch_wait_ms / 1000
        self._next_reap = time.monotonic() + self.REAP_EVERY_S
        self._decoded_at = float("-inf")  # when the last forward with decodes ran
        self._decoders: dict[str, float] = {}  # sequence -> when it last decoded (the last second's)
        self._last_forward_s = 0.0  # how long the last forward with decodes took
        self._prompt_turns: dict[str, int] = {}  # tenant -> when its prompts last got a part (see scheduler.fair)
        self._parked: list[Job] = []  # prompts waiting for room in the pool (see scheduler.take_prompts)
        self._unpark_at = float("inf")
        self._turns = itertools.count()
        self._jobs: deque[Job | None] = deque()
        self._unanswered: set[Future] = set()  # every job's future until it resolves (see fail_all)
        self._cond = threading.Condition()
        self._stopping = False
        # decoding ahead (ahead.py): the runs, and their sequences per tenant (their seats)
        self._runs: list = []
        self.ahead: dict[str, int] = {}
        self.loaded: Future = Future()  # resolves to the executor once the thread has built it
        self.front = AsyncFront(self)  # its calls as coroutines (the rpc layer's)
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

    @property
    def work_queued(self) -> int:
        """Prompts and decode steps waiting: what a new sequence would queue behind, as
        GetStatus reports it.  Quick bookkeeping calls (a status, a release, a KV-event
        watch's snapshot) are left out: a status read while a new client's watch
        snapshot was queued made that replica look busy, and replica placement
        passed it over for a whole status lifetime."""
        with self._cond:
            return sum(1 for job in self._jobs if job is not None and (job.decode or job.prefill))

    @property
    def stopping(self) -> bool:
        """stop() was called: new jobs are refused (queued ones still finish)."""
        return self._stopping

    # Every call that names or makes a sequence takes the caller's ``tenant`` ("" =
    # auth off), from the servicer's edge to the executor: nothing ambient.
    def submit(self, fn: Callable[..., Any], *args: Any, deadline: float | None = None) -> Future:
        """Runs ``fn(*args)`` on the worker thread."""
        return self.put(Job(fn, args, deadline=deadline)).future

    def submit_prefill(self, token_ids: list[int], kv_cache: KvCacheHandle | None,
                       policy: LogitsPolicy | None, deadline: float | None = None, tenant: str = "",
                       choice=None) -> Future:
        """Runs a prompt in parts that share forwards with other callers' work (see
        the module docstring).  A caller that went away, or whose deadline
        passed, has the prompt stopped before its next part, which undoes it.
        ``choice``: a TokenChoice, the next token chosen on the worker."""
        return self.put(self.prefill_job(token_ids, kv_cache, policy, deadline, tenant, choice=choice)).future

    def submit_decode(self, inputs: list[DecodeInput], policy: LogitsPolicy,
                      deadline: float | None = None, tenant: str = "") -> Future:
        """Runs a decode step, batched with the other decodes (and prompt parts) queued with it."""
        return self.put(Job(None, (), decode=DecodeWork(inputs, policy), deadline=deadline, tenant=tenant)).future

    def prefill_job(self, token_ids, kv_cache, policy, deadline, tenant, hidden=None, choice=None,
                     as_output=False, name="", adapter="") -> Job:
        return Job(None, (), prefill=PromptWork(token_ids, kv_cache, policy, hidden, choice, as_output, name, adapter),
                    deadline=deadline, tenant=tenant)

    def release_named(self, name: str, tenant: str) -> int:
        """ReleaseCache by request_id, on this thread between forwards: a prompt still making
        that sequence is stopped before its next part and undone, then it is released."""
        with self._cond:
            creating = [j for j in (*self._jobs, *self._parked) if j is not None and j.prefill is not None
                        and j.prefill.name == name and j.tenant == tenant]
        for job in creating:
            job.abandoned = True  # stopped before its next part and undone (_plan_part)
        return self.executor.release_named(name, tenant, aborted=bool(creating))

    def undo(self, undos: list[Undo], why: str) -> Future:
        """Applies undo records on the worker thread (``TorchExecutor.undo``); refused
        while stopping (the sequences go with the executor)."""
        log.info("undoing %s (%d sequence(s))", why, len(undos))
        return self.submit(self.executor.undo, undos)

    def stop(self, timeout: float | None = None) -> None:
        """Refuses new jobs, finishes every queued one (unfinished prompts included), then
        ends the thread.  No future is left unresolved."""
        with self._cond:
            self._stopping = True
            self._jobs.append(None)
            self._cond.notify()
        self._thread.join(timeout)
        self.executor.kv.events.close()  # WatchKvEvents streams say all_cleared and end

    def fail_all(self, error: ExecutorError) -> None:
        """Fails every call not yet answered with ``error``: for a worker that will never
        answer them (a tensor-parallel rank lost, this thread stuck in a collective)."""
        for future in list(self._unanswered):
            try:
                future.set_exception(error)
            except InvalidStateError:  # answered meanwhile
                pass
        for run in list(self._runs):
            run.end(error, None)

    def put(self, job: Job) -> Job:
        """Queues ``job`` (refused while stopping)."""
        self._unanswered.add(job.future)
        job.future.add_done_callback(self._unanswered.discard)
        with self._cond:
            if self._stopping:
                job.future.set_exception(Draining("the model worker is stopping"))
                return job
            self._jobs.append(job)
            self._cond.notify()
        return job

    def _requeue(self, job: Job) -> None:
        """Puts an unfinished prompt back at the end of the queue (also after a stop: it finishes)."""
        with self._cond:
            self._jobs.append(job)
            self._cond.notify()

    # -- the worker thread --------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._settle_runs()
            with self._cond:
                self._unpark()
                while not self._jobs and not self._runs_want_turn():
                    self._reap()
                    self._cond.wait(self.PARKED_POLL_S if self._parked else self.REAP_EVERY_S)
                    self._unpark()
                if self._runs_to_settle():
                    continue  # ended and undone first (the top of the loop): a call behind it sees its undo
                job = self._jobs[0] if self._jobs else None
                if job is None and self._jobs:
                    if any(self._runs):
                        continue  # runs end (Draining) before the thread does: _settle_runs
                    self._jobs.popleft()
                    if not self._jobs:
                        return
                    self._jobs.append(None)  # prompts re-queued behind the stop finish first
                    continue
                decodes: list[Job] | None = None
                burst = None  # the runs alone (nothing queued), in a burst of forwards (runs.py)
                if job is not None and not (job.decode or job.prefill) or job is not None and job.analysis:
                    self._jobs.popleft()  # a call, or an analysis prompt: alone
                elif job is not None or not (burst := self._burst_runs()):
                    decodes = [self._run_job(run) for run in self._runs if run.running and not run.paused]
                    if job is not None and job.decode:
                        decodes.append(self._jobs.popleft())
                    self._collect(decodes)
            self._reap()
            if burst:
                self._burst(burst)
                continue
            if decodes is None:
                if job.prefill:  # an analysis prompt: one part, alone
                    self._run_step([], [(job, self.executor.config.prefill_chunk)])
                else:
                    self._run(job)
                    self._unpark_at = 0.0  # a release, truncate or expiry may have made room
                continue
            if decodes and self.batch_wait_s:
                self._wait_for_more(decodes)
            elif self.executor.config.step_token_budget:
                self._wait_for_decoders(decodes)
            with self._cond:
                prompts = self._take_prompts(decodes)
            self._run_step(decodes, prompts)
            if any(job.future.done() for job, _ in prompts):  # a prompt ended: waiting ones may fit now
                self._unpark_at = 0.0

    # -- the policy (scheduler.py) over a snapshot of the queue ---------------------
    def _limits(self) -> scheduler.Limits:
        cfg = self.executor.config
        return scheduler.Limits(cfg.max_batch_size, cfg.step_token_budget, cfg.prefill_chunk)

    def _view(self, job: Job | None) -> scheduler.Queued:
        """How the policy sees a queued job (lock held)."""
        if job is None or not (job.decode or job.prefill):
            return scheduler.Queued(id(job), scheduler.Kind.OTHER)
        if job.decode:
            return scheduler.Queued(id(job), scheduler.Kind.DECODE, job.tenant,
                                    tuple(i.kv_cache.cache_id for i in job.decode.inputs))
        seq = job.sequence()
        patient = job.parked_at is None or time.monotonic() - job.parked_at < self.ADMISSION_WAIT_S
        return scheduler.Queued(
            id(job), scheduler.Kind.PROMPT, job.tenant, (seq,) if seq is not None else (),
            remaining=job.prompt.remaining if job.prompt is not None else len(job.prefill.token_ids),
            started=job.prompt is not None, blocks_to_finish=self._blocks_to_finish(job),
            must_run=self._stopping or job.gone() is not None or self._never_fits(job), patient=patient,
            analysis=job.analysis)

    def _snapshot(self) -> tuple[list[scheduler.Queued], dict[int, Job]]:
        return [self._view(j) for j in self._jobs], {id(j): j for j in self._jobs if j is not None}

    def _remove(self, jobs: list[Job]) -> None:  # lock held
        ids = {id(j) for j in jobs}
        kept = [j for j in self._jobs if id(j) not in ids]
        self._jobs.clear()
        self._jobs.extend(kept)

    def _collect(self, batch: list[Job]) -> bool:
        """Moves queued decodes into ``batch`` while they fit (lock held), fairly
        across tenants (``scheduler.take_decodes``).  Returns True if the batch is
        closed (full, a job that does not fit, or the window ends before the queue does)."""
        if not self._jobs:  # nothing queued (a run decoding ahead alone): closed only when full
            return sum(len(j.decode.inputs) for j in batch) >= self.executor.config.max_batch_size
        queue, jobs = self._snapshot()
        taken, closed = scheduler.take_decodes(queue, [self._view(j) for j in batch], self._limits())
        batch.extend(jobs[q.key] for q in taken)
        self._remove([jobs[q.key] for q in taken])
        return closed

    def _take_prompts(self, decodes: list[Job]) -> list[tuple[Job, int]]:
        """Takes the prompts that get a part of this forward and how many tokens each
        may run, and parks those the pool cannot hold yet (lock held; see scheduler.py)."""
        if not self._jobs:  # no prompt queued: none to take or park
            return []
        limits = self._limits()
        rows = sum(len(j.decode.inputs) for j in decodes)
        active = time.monotonic() - self._decoded_at < self.DECODERS_ACTIVE_S
        queue, jobs = self._snapshot()
        plan = scheduler.take_prompts(queue, [self._view(j) for j in decodes], limits,
                                      scheduler.prompt_room(limits, rows, active), self.executor.kv.num_free,
                                      self._prompt_turns)
        for key in plan.parked:
            self._park(jobs[key])
        taken = [(jobs[key], tokens) for key, tokens in plan.parts]
        self._remove([job for job, _ in taken])
        for job, _ in taken:
            self._prompt_turns[job.tenant] = next(self._turns)
        return taken

    def _blocks_to_finish(self, job: Job) -> int:
        """KV blocks a prompt still needs to finish (an upper bound: a cached prefix
        may need fewer; a continuation that starts inside a shared block one more)."""
        kv = self.executor.kv
        if job.prompt is not None:
            length = job.prompt.opened.seq.length
            return kv.blocks_for(length + job.prompt.remaining) - kv.blocks_for(length)
        tokens, handle = job.prefill.token_ids, job.prefill.kv_cache
        start = handle.sequence_length if handle is not None else 0
        return kv.blocks_for(start + len(tokens)) - kv.blocks_for(start) + (1 if start % kv.block_size else 0)

    def _never_fits(self, job: Job) -> bool:
        """A prompt no wait can admit (the executor's length and whole-pool checks refuse
        it): it runs at once, so its open fails with its own reason without waiting."""
        if job.prompt is not None:
            return False
        handle, tokens = job.prefill.kv_cache, len(job.prefill.token_ids)
        start = handle.sequence_length if handle is not None else 0
        try:
            self.executor.checks.length(start, tokens)
            self.executor.checks.fits_pool(start + tokens)
        except ExecutorError:
            return True
        return False

    def _park(self, job: Job) -> None:  # lock held
        if job.parked_at is None:
            job.parked_at = time.monotonic()  # its admission wait starts
        self._jobs.remove(job)
        self._parked.append(job)
        self._unpark_at = min(self._unpark_at, time.monotonic() + self.PARKED_POLL_S)

    def _unpark(self) -> None:
        """Puts waiting prompts back at the end of the queue once the pool may have
        changed (lock held).  Jobs behind a waiting prompt are never held up by it."""
        if self._parked and (time.monotonic() >= self._unpark_at or self._stopping):
            self._jobs.extend(self._parked)
            self._parked.clear()
            self._unpark_at = float("inf")

    def _wait_for_more(self, batch: list[Job]) -> None:
        deadline = time.monotonic() + self.batch_wait_s
        with self._cond:
            while not self._collect(batch) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def _wait_for_decoders(self, batch: list[Job]) -> None:
        """Waits briefly for the decoders of the last second that are not queued yet.

        Callers drive decoding one call per token, so after a forward their next
        calls trickle back over a few milliseconds.  Without this, the next
        forward takes the first few and the rest wait out a whole forward
        (with prompt parts in it, a long one): the decoders split into groups
        that alternate, doubling everyone's step time.  The wait is bounded by
        a quarter of the last decode forward and 50 ms; it ends as soon as every
        recent decoder is in (or the batch is closed)."""
        now = time.monotonic()
        # A released (or expired, or moved) sequence never calls again: waiting for it cost
        # every other decoder a quarter of a forward per step for a second (bench.decode_throughput).
        for cid in [c for c, t in self._decoders.items()
                    if now - t > self.DECODERS_ACTIVE_S or c not in self.executor.kv]:
            del self._decoders[cid]
        if not self._decoders:
            return
        deadline = now + min(0.25 * self._last_forward_s, 0.05)
        with self._cond:
            while not self._collect(batch) and (left := deadline - time.monotonic()) > 0:
                if not scheduler.still_waiting_for(set(self._decoders), [self._view(j) for j in batch],
                                                   [self._view(j) for j in self._jobs]):
                    return
                self._cond.wait(left)

    def _reap(self) -> None:
        now = time.monotonic()
        if now >= self._next_reap:
            self._next_reap = now + self.REAP_EVERY_S
            try:
                self.executor.expire_idle()
            except Exception:  # bookkeeping must never kill the worker
                log.exception("idle reclamation failed")

    def _run(self, job: Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        if (gone := job.gone()) is not None:
            job.future.set_exception(gone)
            return
        queue_ns = time.perf_counter_ns() - job.enqueued_ns
        try:
            result = job.fn(*job.args)
        except BaseException as exc:  # handed to the caller, never lost
            job.future.set_exception(exc)
            return
        job.future.set_result(with_queue_time(result, queue_ns))

    def _plan_part(self, job: Job, tokens: int) -> Any:
        """Opens a prompt on its first part, then plans its next part of up to ``tokens``;
        None (with the job answered) if it failed or its caller went away, or (parked) if
        its request_id's sequence is still being made by an earlier call."""
        ex = self.executor
        if job.prompt is None and not job.future.running():  # running already: it waited on a name
            if not job.future.set_running_or_notify_cancel():
                return None
            job.queue_ns = time.perf_counter_ns() - job.enqueued_ns
        if (gone := job.gone()) is not None:  # nobody waits for it: undo its parts so far
            if job.prompt is not None:
                job.prompt.undo()
            job.future.set_exception(gone)
            return None
        try:
            if job.prompt is None:
                p = job.prefill
                job.prompt = ex.open_prefill(p.token_ids, p.kv_cache, p.policy, p.hidden, tenant=job.tenant,
                                             choice=p.choice, as_output=p.as_output, name=p.name,
                                             adapter=p.adapter)
            return job.prompt.next_part(tokens)
        except RequestIdBusy:  # an earlier call still makes its name's sequence: waits for that call's outcome
            with self._cond:
                self._jobs.append(job)
                self._park(job)
            return None
        except BaseException as exc:
            if job.prompt is not None:
                job.prompt.undo()
            job.future.set_exception(exc)
            return None

    def _run_step(self, decodes: list[Job], prompts: list[tuple[Job, int]]) -> None:
        """Plans every decode and prompt part (a job whose plan fails gets its error
        alone), runs them all as one forward, and hands each decode its result and
        each prompt its part's; an unfinished prompt goes back in the queue."""
        start = time.perf_counter_ns()
        planned: list[tuple[Job, Any]] = []
        for job in decodes:
            if not job.future.set_running_or_notify_cancel():
                continue
            if (gone := job.gone()) is not None:  # nobody waits for it: do not run it
                job.future.set_exception(gone)
                continue
            try:
                planned.append((job, self.executor.plan_decode(job.decode.inputs, job.decode.policy,
                                                                       tenant=job.tenant)))
            except BaseException as exc:
                job.future.set_exception(exc)
        for job, tokens in prompts:
            if (plan := self._plan_part(job, tokens)) is not None:
                planned.append((job, plan))
        if not planned:
            return
        t0 = time.perf_counter_ns()
        try:
            results = self.executor.run([p for _, p in planned])
        except BaseException as exc:  # run() put every sequence back; prompts undo their earlier parts
            if not isinstance(exc, ExecutorError):
                log.exception("batched forward failed")
            for job, _ in planned:
                if job.prompt is not None:
                    job.prompt.undo()
                job.future.set_exception(exc)
            return
        forward_ns, steps = time.perf_counter_ns() - t0, sum(len(p.steps) for _, p in planned)
        if decodes:
            self._decoded_at = now = time.monotonic()
            self._last_forward_s = forward_ns / 1e9
            for job in decodes:
                for item in job.decode.inputs if job.run is None else ():  # a run's rows are always in
                    self._decoders[item.kv_cache.cache_id] = now
        for (job, plan), result in zip(planned, results):
            if not isinstance(result, BaseException) and (gone := job.gone()) is not None:
                # its caller stopped waiting during the forward: what it committed goes back
                if job.decode:
                    self.executor.undo(job.decode.undo(result))
                result = gone
            if isinstance(result, BaseException):  # this call's own rows failed; run() undid it
                if job.prompt is not None:
                    job.prompt.undo()
                job.future.set_exception(result)
                continue
            if job.decode:
                job.future.set_result(with_queue_time(result, start - job.enqueued_ns))
                continue
            try:
                done = job.prompt.part_done(plan, result, forward_ns, steps)
            except BaseException as exc:
                job.future.set_exception(exc)
                continue
            if done is None:
                self._requeue(job)
            else:
                job.future.set_result(with_queue_time(done, job.queue_ns))
