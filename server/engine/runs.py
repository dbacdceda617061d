"""The model worker's decode-ahead runs (``ahead.py``): starting one (its seats), adding
the runs that are not paused to each forward, advancing them with its results, and
ending those whose caller went away, whose deadline passed or whose worker stops.

When the runs' rows are all a forward would hold (nothing queued, no other caller
decoding) and no row's choice reads its history (penalties), the runs go on in bursts
(``burst.py``): several forwards, then each forward's entries as single steps would
have made them.  A burst ends after any forward once something waits for the worker:
a queued call, a run that could join, a cancel, a stop, a passed deadline, or a stop
token chosen."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Callable

from ferrum_rpc.errors import (Cancelled, DeadlineExceeded, Draining, ExecutorError, SequenceLimitExceeded,
                               TenantQuotaExceeded)
from ferrum_rpc.types import DecodeInput
from .ahead import QUEUED_FORWARDS, AheadRun
from .burst import Burst, bursts_serve
from .jobs import DecodeWork, Job
from .queue import WorkQueue
from .scheduler import Scheduler, StepPlan

if TYPE_CHECKING:
    from .executor import TorchExecutor

log = logging.getLogger(__name__)

BURST_FORWARDS = 16  # a burst's most forwards: its entries reach the consumer when it ends
PLAIN_AFTER_FALLBACK = 16  # forwards run as plain steps after a burst's first forward could not count


class AheadRuns:
    """The worker's decode-ahead runs, a client of its loop: the loop asks whether
    they want a turn (:meth:`want_turn`), ends those that must end (:meth:`settle`),
    adds their decode jobs to a plain step (:meth:`step_jobs`) or lets them go on in
    a burst (:meth:`burst_candidates`, :meth:`burst`).

    Args:
        step: runs a plan as one forward and gives its result to the scheduler (the loop's).
        undo: applies undo records on the worker thread, queued as a call.
    """

    def __init__(self, queue: WorkQueue, scheduler: Scheduler, executor: TorchExecutor,
                 step: Callable[[StepPlan], None], undo: Callable[[list], Future]):
        self.queue, self.scheduler, self.executor = queue, scheduler, executor
        self._step, self._undo = step, undo
        self.runs: list[AheadRun] = []
        self.seats: dict[str, int] = {}  # tenant -> its sequences decoding ahead
        self.bursts = True  # runs may go on in bursts (False: every forward a plain step, as benchmarks compare)
        self._plain_steps = 0  # forwards left to run as plain steps before runs may burst again

    def start(self, items: list[DecodeInput], limit: int, stop_ids: frozenset[int], tenant: str,
                    deadline: float | None, bound: int = QUEUED_FORWARDS) -> AheadRun:
        """Starts decoding ``items`` ahead on the worker (see ``ahead.py``): up to ``limit``
        tokens each, ``bound`` forwards queued before the run pauses.  Takes a seat per
        sequence for the run's life; refuses (TENANT_QUOTA_EXCEEDED) past the tenant's
        bound, so one tenant's runs take a bounded share of every forward, and
        (SEQUENCE_LIMIT_EXCEEDED) past --max-batch in all."""
        with self.queue.cond:
            cap, held = self.executor.bounds(tenant).ahead_sequences, self.seats.get(tenant, 0)
            if cap and held + len(items) > cap:
                raise TenantQuotaExceeded(
                    f"your tenant has {held} sequences decoding ahead, its cap is {cap} (--tenant-ahead-sequences); "
                    f"this step's {len(items)} would pass it: wait for a run to end or stop one")
            total, room = sum(self.seats.values()), self.executor.config.max_batch_size
            if total + len(items) > room:  # in total too: more than one forward holds would only queue
                raise SequenceLimitExceeded(
                    f"the server has {total} sequences decoding ahead, its cap is {room} (--max-batch); "
                    f"this step's {len(items)} would pass it: wait for a run to end")
            if self.queue.stopping:
                raise Draining("the model worker is stopping")
            run = AheadRun(items, limit, stop_ids, self.executor.max_seq_len, tenant, deadline, bound,
                           self._undo, self.queue.wake)
            self.seats[tenant] = held + len(items)
            self.runs.append(run)
            self.queue.cond.notify()
        return run

    @property
    def paused(self) -> int:
        """Runs now waiting for their consumer to take their queued tokens."""
        return sum(1 for run in self.runs if run.running and run.paused)

    def fail_all(self, error: ExecutorError) -> None:
        """Ends every run with ``error``, undoing nothing (the worker will never run again)."""
        for run in list(self.runs):
            run.end(error, None)

    def want_turn(self) -> bool:
        """A run can join a forward, or must be ended (lock held)."""
        return any(run.running and not run.paused for run in self.runs) or self.to_settle()

    def step_jobs(self) -> list[Job]:
        """The decode jobs of the runs that join the next plain step (lock held)."""
        return [self._run_job(run) for run in self.runs if run.running and not run.paused]

    def to_settle(self) -> bool:
        """A running run must be ended before anything else runs (lock held): its caller
        went away, its deadline passed, or the worker stops."""
        now = time.monotonic()
        return any(run.running and (run.cancelled or self.queue.stopping
                                    or run.deadline is not None and now > run.deadline) for run in self.runs)

    def settle(self) -> None:
        """Ends the runs whose caller went away, whose deadline passed or whose worker is
        stopping (undoing them), and lets go of the runs that ended."""
        now = time.monotonic()
        for run in list(self.runs):
            if not run.running:
                pass
            elif run.cancelled:
                run.end(Cancelled("the caller cancelled the call"), self.executor.undo)
            elif run.deadline is not None and now > run.deadline:
                run.end(DeadlineExceeded("the caller's deadline passed; the run was undone"), self.executor.undo)
            elif self.queue.stopping:
                run.end(Draining("the model worker is stopping"), self.executor.undo)
            if not run.running:
                self._let_go(run)

    def _let_go(self, run: AheadRun) -> None:
        with self.queue.cond:
            if run not in self.runs:
                return
            self.runs.remove(run)
            if (left := self.seats[run.tenant] - len(run.items)) > 0:
                self.seats[run.tenant] = left
            else:
                del self.seats[run.tenant]

    def burst_candidates(self) -> list[AheadRun] | None:
        """The runs to go on in a burst, or None where the next forward is a plain step
        (lock held): something is queued or waits for room, a unary decoder was active
        within the last second (its next call joins a plain step), or a row cannot take
        a burst (``bursts_serve``)."""
        if self._plain_steps:
            self._plain_steps -= 1
            return None
        if not self.bursts or self.queue.jobs or self.queue.parked or self.scheduler.batch_wait_s:
            return None
        if self.scheduler.unary_decoders_active():
            return None
        runs = [run for run in self.runs if run.running and not run.paused]
        if not runs or any(run.cancelled or run.stop_requested for run in runs):
            return None
        if not all(bursts_serve(self.executor, item) for run in runs for item in run.inputs()):
            return None
        return runs

    def burst(self, runs: list[AheadRun]) -> None:
        """Runs ``runs`` in a burst, then advances each with every forward's entry; a
        burst that cannot run (``Burst.open``) or whose first forward does not count
        is one plain step instead."""
        ex = self.executor
        inputs = [item for run in runs for item in run.inputs()]
        cap = min(BURST_FORWARDS, *(run.bound - run.queued for run in runs),
                  *(run.limit - run.emitted[index] for run in runs for index, _ in run.live))
        burst = Burst.open(ex, inputs, [run.tenant for run in runs for _ in run.live], cap)
        if burst is None:
            self._step(StepPlan(tuple(self._run_job(run) for run in runs)))
            return
        stops = [run.stop_ids for run in runs for _ in run.live]
        deadlines = [run.deadline for run in runs if run.deadline is not None]
        try:
            while burst.done < burst.forwards:
                tokens = burst.forward()
                if tokens is None or any(t in s for t, s in zip(tokens, stops)) or self._burst_ends(runs, deadlines):
                    break
        except BaseException as exc:  # the runs end with it, and are undone, as after a plain step's failure
            burst.release_unused()
            ex.stats.failed = not isinstance(exc, (ExecutorError, GeneratorExit, KeyboardInterrupt))
            if not isinstance(exc, ExecutorError):
                log.exception("batched forward failed")
            for run in runs:
                run.end(exc, ex.undo)
                self._let_go(run)
            return
        if not burst.done:
            burst.release_unused()
            log.info("a burst's first forward has a row no token can be chosen for; the next %d forwards "
                     "run as plain steps", PLAIN_AFTER_FALLBACK)
            self._plain_steps = PLAIN_AFTER_FALLBACK
            self._step(StepPlan(tuple(self._run_job(run) for run in runs)))
            return
        ex.stats.failed = False
        spans, first = [], 0
        for run in runs:
            spans.append((run, range(first, first + len(run.live))))
            first += len(run.live)
        self._advance_by(burst, spans)
        self.scheduler.burst_ran(burst.ns[-1])

    def _burst_ends(self, runs: list[AheadRun], deadlines: list[float]) -> bool:
        """Something waits for the worker: a queued call, another run that could join, a
        run cancelled or stopped, or a deadline passed.  Other runs exist only where the
        worker holds more runs than the burst (one starts on another thread)."""
        return bool(self.queue.jobs or any(run.cancelled or run.stop_requested or not run.running for run in runs)
                    or deadlines and time.monotonic() > min(deadlines)
                    or len(self.runs) != len(runs)
                    and any(run.running and not run.paused and run not in runs for run in self.runs))

    def _advance_by(self, burst: Burst, spans: list[tuple[AheadRun, range]]) -> None:
        """Each forward of ``burst`` in order: each run's rows (its span of the burst's)
        committed, then its entry given to the run, while the run goes on.  A stop asked
        for during the burst ends the run at the last forward (the burst ended there on
        seeing it), as it ends a plain step's run after its current forward."""
        for f in range(burst.done):
            for run, rows in spans:
                if run.running and len(run.live) == len(rows):
                    outs = burst.commit(f, rows)
                    try:
                        run.advance(outs, seen_stop=f == burst.done - 1)
                    except Exception:  # its consumer's wake-up failed: logged, as a plain step's callback's is
                        log.exception("advancing a decode-ahead run failed")
        burst.release_unused()
        for run, _ in spans:
            self._after_entries(run)

    def _run_job(self, run: AheadRun) -> Job:
        """The run's live sequences as this forward's decode job; its result advances the run."""
        job = Job(None, (), decode=DecodeWork(run.inputs(), None), deadline=run.deadline, tenant=run.tenant, run=run)
        job.future.add_done_callback(lambda future: self._forwarded(run, future))
        return job

    def _forwarded(self, run: AheadRun, future: Future) -> None:  # this thread, as the job resolves
        if (error := future.exception()) is not None:
            run.end(error, self.executor.undo)  # run() put this forward's sequences back
        else:
            run.advance(future.result())
        self._after_entries(run)

    def _after_entries(self, run: AheadRun) -> None:
        """After a forward's (or a burst's) entries: ends the run undone if its caller went
        away meanwhile, and lets go of it once it no longer runs (finished or ended)."""
        if run.cancelled:
            run.end(Cancelled("the caller cancelled the call"), self.executor.undo)
        if not run.running:
            self._let_go(run)
