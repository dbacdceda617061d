"""The model worker's decode-ahead runs (``ahead.py``): starting one (its seats), adding
the runs that are not paused to each forward, advancing them with its results, and
ending those whose caller went away, whose deadline passed or whose worker stops."""

from __future__ import annotations

import time
from concurrent.futures import Future

from ferrum_rpc.errors import (Cancelled, DeadlineExceeded, Draining, SequenceLimitExceeded,
                               TenantQuotaExceeded)
from ferrum_rpc.types import DecodeInput
from .ahead import QUEUED_FORWARDS, AheadRun
from .jobs import DecodeWork, Job


class DrivesRuns:
    """Mixed into :class:`~.worker.ModelWorker` (its ``_cond``, ``_runs``, ``ahead``,
    ``_stopping``, ``executor`` and ``undo``); ``_runs_want_turn``, ``_settle_runs`` and
    ``_run_job`` are called by its loop."""

    def start_ahead(self, items: list[DecodeInput], limit: int, stop_ids: frozenset[int], tenant: str,
                    deadline: float | None, bound: int = QUEUED_FORWARDS) -> AheadRun:
        """Starts decoding ``items`` ahead on the worker (see ``ahead.py``): up to ``limit``
        tokens each, ``bound`` forwards queued before the run pauses.  Takes a seat per
        sequence for the run's life; refuses (TENANT_QUOTA_EXCEEDED) past the tenant's
        bound, so one tenant's runs take a bounded share of every forward, and
        (SEQUENCE_LIMIT_EXCEEDED) past --max-batch in all."""
        with self._cond:
            cap, held = self.executor.bounds(tenant).ahead_sequences, self.ahead.get(tenant, 0)
            if cap and held + len(items) > cap:
                raise TenantQuotaExceeded(
                    f"your tenant has {held} sequences decoding ahead, its cap is {cap} (--tenant-ahead-sequences); "
                    f"this step's {len(items)} would pass it: wait for a run to end or stop one")
            total, room = sum(self.ahead.values()), self.executor.config.max_batch_size
            if total + len(items) > room:  # in total too: more than one forward holds would only queue
                raise SequenceLimitExceeded(
                    f"the server has {total} sequences decoding ahead, its cap is {room} (--max-batch); "
                    f"this step's {len(items)} would pass it: wait for a run to end")
            if self._stopping:
                raise Draining("the model worker is stopping")
            run = AheadRun(items, limit, stop_ids, self.executor.max_seq_len, tenant, deadline, bound,
                           lambda undos: self.undo(undos, "a finished run whose caller went away"), self._wake)
            self.ahead[tenant] = held + len(items)
            self._runs.append(run)
            self._cond.notify()
        return run

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    @property
    def ahead_paused(self) -> int:
        """Runs now waiting for their consumer to take their queued tokens."""
        return sum(1 for run in self._runs if run.running and run.paused)

    def _runs_want_turn(self) -> bool:
        """A run can join a forward, or must be ended (lock held)."""
        return any(run.running and not run.paused for run in self._runs) or self._runs_to_settle()

    def _runs_to_settle(self) -> bool:
        """A running run must be ended before anything else runs (lock held): its caller
        went away, its deadline passed, or the worker stops."""
        now = time.monotonic()
        return any(run.running and (run.cancelled or self._stopping
                                    or run.deadline is not None and now > run.deadline) for run in self._runs)

    def _settle_runs(self) -> None:
        """Ends the runs whose caller went away, whose deadline passed or whose worker is
        stopping (undoing them), and lets go of the runs that ended."""
        now = time.monotonic()
        for run in list(self._runs):
            if not run.running:
                pass
            elif run.cancelled:
                run.end(Cancelled("the caller cancelled the call"), self.executor.undo)
            elif run.deadline is not None and now > run.deadline:
                run.end(DeadlineExceeded("the caller's deadline passed; the run was undone"), self.executor.undo)
            elif self._stopping:
                run.end(Draining("the model worker is stopping"), self.executor.undo)
            if not run.running:
                self._let_go(run)

    def _let_go(self, run: AheadRun) -> None:
        with self._cond:
            if run not in self._runs:
                return
            self._runs.remove(run)
            if (left := self.ahead[run.tenant] - len(run.items)) > 0:
                self.ahead[run.tenant] = left
            else:
                del self.ahead[run.tenant]

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
            if run.cancelled:
                run.end(Cancelled("the caller cancelled the call"), self.executor.undo)
        if not run.running:
            self._let_go(run)
