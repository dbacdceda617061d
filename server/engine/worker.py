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

The parts, each composed here: the queue (``queue.py``); the scheduler
(``scheduler.py``, over the policy's pure functions in ``policy.py``), which
returns each forward's plan; the runner (``runner.py``), which executes a plan
and commits or undoes each job in it; and the decode-ahead runs (``runs.py``), a
client of the loop.  This module holds the thread and the one loop: schedule,
run, commit.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable

from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.types import DecodeInput, KvCacheHandle, LogitsPolicy
from .ahead import QUEUED_FORWARDS, AheadRun
from .executor import TorchExecutor
from .front import AsyncFront
from .jobs import DecodeWork, Job, PromptWork
from .queue import WorkQueue
from .runner import Runner
from .runs import AheadRuns
from .scheduler import Scheduler, StepPlan
from .undo import Undo

log = logging.getLogger(__name__)


class ModelWorker:
    """Serialises access to one executor on a dedicated thread.

    Args:
        load: builds the executor; runs on the worker thread (see the module docstring).
        name: names the thread.
        batch_wait_ms: after taking a decode, wait this long for more to batch.
    """

    REAP_EVERY_S = 1.0
    ADMISSION_WAIT_S = Scheduler.ADMISSION_WAIT_S

    def __init__(self, load: Callable[[], TorchExecutor], name: str = "model", batch_wait_ms: float = 0.0):
        self.executor: TorchExecutor | None = None
        self.queue = WorkQueue()
        # built with the executor, on the worker thread (see _main)
        self.scheduler: Scheduler | None = None
        self.runner: Runner | None = None
        self.runs: AheadRuns | None = None
        self._batch_wait_s = batch_wait_ms / 1000
        self._next_reap = time.monotonic() + self.REAP_EVERY_S
        self.loaded: Future = Future()  # resolves to the executor once the thread has built it
        self.front = AsyncFront(self)  # its calls as coroutines (the rpc layer's)
        self._thread = threading.Thread(target=self._main, args=(load,), name=f"model-worker[{name}]",
                                        daemon=True)
        self._thread.start()

    async def started(self) -> TorchExecutor:
        return await asyncio.wrap_future(self.loaded)

    def _main(self, load: Callable[[], TorchExecutor]) -> None:
        try:
            self.executor = ex = load()
        except BaseException as exc:
            self.loaded.set_exception(exc)
            return
        self.scheduler = Scheduler(self.queue, ex, self._batch_wait_s)
        self.runner = Runner(self.queue, ex)
        self.runs = AheadRuns(self.queue, self.scheduler, ex, self._step,
                              lambda undos: self.undo(undos, "a finished run whose caller went away"))
        self.loaded.set_result(ex)
        self._loop()

    @property
    def queue_depth(self) -> int:
        return len(self.queue)

    @property
    def work_queued(self) -> int:
        """Prompts and decode steps waiting: what a new sequence would queue behind, as
        GetStatus reports it.  Quick bookkeeping calls (a status, a release, a KV-event
        watch's snapshot) are left out: a status read while a new client's watch
        snapshot was queued made that replica look busy, and replica placement
        passed it over for a whole status lifetime."""
        return self.queue.work_queued

    @property
    def stopping(self) -> bool:
        """stop() was called: new jobs are refused (queued ones still finish)."""
        return self.queue.stopping

    @property
    def ahead(self) -> dict[str, int]:
        """Sequences decoding ahead, per tenant (their seats)."""
        return self.runs.seats if self.runs is not None else {}

    @property
    def ahead_paused(self) -> int:
        """Runs now waiting for their consumer to take their queued tokens."""
        return self.runs.paused if self.runs is not None else 0

    @property
    def bursts(self) -> bool:
        """Runs may go on in bursts (False: every forward a plain step, as benchmarks compare)."""
        return self.runs.bursts

    @bursts.setter
    def bursts(self, on: bool) -> None:
        self.runs.bursts = on

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

    def start_ahead(self, items: list[DecodeInput], limit: int, stop_ids: frozenset[int], tenant: str,
                    deadline: float | None, bound: int = QUEUED_FORWARDS) -> AheadRun:
        """Starts decoding ``items`` ahead on the worker (``AheadRuns.start``)."""
        return self.runs.start(items, limit, stop_ids, tenant, deadline, bound)

    def release_named(self, name: str, tenant: str) -> int:
        """ReleaseCache by request_id, on this thread between forwards: a prompt still making
        that sequence is stopped before its next part and undone, then it is released."""
        creating = self.queue.creating(name, tenant)
        for job in creating:
            job.abandoned = True  # stopped before its next part and undone (Runner._plan_part)
        return self.executor.release_named(name, tenant, aborted=bool(creating))

    def undo(self, undos: list[Undo], why: str) -> Future:
        """Applies undo records on the worker thread (``TorchExecutor.undo``); refused
        while stopping (the sequences go with the executor)."""
        log.info("undoing %s (%d sequence(s))", why, len(undos))
        return self.submit(self.executor.undo, undos)

    def stop(self, timeout: float | None = None) -> None:
        """Refuses new jobs, finishes every queued one (unfinished prompts included), then
        ends the thread.  No future is left unresolved."""
        self.queue.stop()
        self._thread.join(timeout)
        self.executor.kv.events.close()  # WatchKvEvents streams say all_cleared and end

    def fail_all(self, error: ExecutorError) -> None:
        """Fails every call not yet answered with ``error``: for a worker that will never
        answer them (a tensor-parallel rank lost, this thread stuck in a collective)."""
        self.queue.fail_all(error)
        if self.runs is not None:
            self.runs.fail_all(error)

    def put(self, job: Job) -> Job:
        """Queues ``job`` (refused while stopping)."""
        return self.queue.put(job)

    # -- the worker thread: schedule, run, commit ------------------------------------
    def _step(self, plan: StepPlan) -> None:
        self.scheduler.ran(plan, self.runner.run(plan))

    def _loop(self) -> None:
        q, runs = self.queue, self.runs
        while True:
            runs.settle()
            with q.cond:
                q.unpark()
                while not q.jobs and not runs.want_turn():
                    self._reap()
                    q.cond.wait(q.PARKED_POLL_S if q.parked else self.REAP_EVERY_S)
                    q.unpark()
                if runs.to_settle():
                    continue  # ended and undone first (the top of the loop): a call behind it sees its undo
                job = q.jobs[0] if q.jobs else None
                if job is None and q.jobs:
                    if runs.runs:
                        continue  # runs end (Draining) before the thread does: runs.settle
                    q.jobs.popleft()
                    if not q.jobs:
                        return
                    q.jobs.append(None)  # prompts re-queued behind the stop finish first
                    continue
                decodes: list[Job] | None = None
                burst = None  # the runs alone (nothing queued), in a burst of forwards (runs.py)
                if job is not None and not (job.decode or job.prefill) or job is not None and job.analysis:
                    q.jobs.popleft()  # a call, or an analysis prompt: alone
                elif job is not None or not (burst := runs.burst_candidates()):
                    decodes = runs.step_jobs()
                    if job is not None and job.decode:
                        decodes.append(q.jobs.popleft())
                    self.scheduler.collect(decodes)
            self._reap()
            if burst:
                runs.burst(burst)
                continue
            if decodes is None:
                if job.prefill:  # an analysis prompt: one part, alone
                    self._step(StepPlan((), ((job, self.executor.config.prefill_chunk),)))
                else:
                    self.runner.call(job)
                    q.room_may_have_changed()
                continue
            plan = self.scheduler.plan(decodes)
            self._step(plan)
            if any(job.future.done() for job, _ in plan.prompts):  # a prompt ended: waiting ones may fit now
                q.room_may_have_changed()

    def _reap(self) -> None:
        now = time.monotonic()
        if now >= self._next_reap:
            self._next_reap = now + self.REAP_EVERY_S
            try:
                self.executor.expire_idle()
            except Exception:  # bookkeeping must never kill the worker
                log.exception("idle reclamation failed")
