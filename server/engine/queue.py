"""The model worker's queue: jobs in arrival order, the prompts parked until the pool
may hold them, and every future not yet answered.

Every part of the worker (the scheduler, the runner, the decode-ahead runs, the
loop) reads and changes it under its one condition variable, ``cond``; a job is
put by any thread and taken only by the worker's."""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future, InvalidStateError

from ferrum_rpc.errors import Draining, ExecutorError
from .jobs import Job


class WorkQueue:
    PARKED_POLL_S = 0.02  # how often parked prompts look for room again

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: deque[Job | None] = deque()  # None: the stop marker (see ``stop``)
        self.parked: list[Job] = []  # prompts waiting for room in the pool (see policy.take_prompts)
        self.unpark_at = float("inf")
        self.stopping = False
        self._unanswered: set[Future] = set()  # every job's future until it resolves (see fail_all)

    def __len__(self) -> int:
        return len(self.jobs)

    @property
    def work_queued(self) -> int:
        """Prompts and decode steps waiting (calls left out: see ``ModelWorker.work_queued``)."""
        with self.cond:
            return sum(1 for job in self.jobs if job is not None and (job.decode or job.prefill))

    def put(self, job: Job) -> Job:
        """Queues ``job`` (refused while stopping)."""
        self._unanswered.add(job.future)
        job.future.add_done_callback(self._unanswered.discard)
        with self.cond:
            if self.stopping:
                job.future.set_exception(Draining("the model worker is stopping"))
                return job
            self.jobs.append(job)
            self.cond.notify()
        return job

    def requeue(self, job: Job) -> None:
        """Puts an unfinished prompt back at the end of the queue (also after a stop: it finishes)."""
        with self.cond:
            self.jobs.append(job)
            self.cond.notify()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify()

    def stop(self) -> None:
        """Refuses new jobs; the stop marker goes behind the queued ones."""
        with self.cond:
            self.stopping = True
            self.jobs.append(None)
            self.cond.notify()

    def fail_all(self, error: ExecutorError) -> None:
        """Fails every job not yet answered with ``error``."""
        for future in list(self._unanswered):
            try:
                future.set_exception(error)
            except InvalidStateError:  # answered meanwhile
                pass

    def creating(self, name: str, tenant: str) -> list[Job]:
        """The queued or parked prompts making ``tenant``'s sequence named ``name``."""
        with self.cond:
            return [j for j in (*self.jobs, *self.parked) if j is not None and j.prefill is not None
                    and j.prefill.name == name and j.tenant == tenant]

    def remove(self, jobs: list[Job]) -> None:  # lock held
        ids = {id(j) for j in jobs}
        kept = [j for j in self.jobs if id(j) not in ids]
        self.jobs.clear()
        self.jobs.extend(kept)

    def park(self, job: Job) -> None:  # lock held
        """Moves a queued prompt aside until the pool may have room (its admission wait starts)."""
        if job.parked_at is None:
            job.parked_at = time.monotonic()
        self.jobs.remove(job)
        self.parked.append(job)
        self.unpark_at = min(self.unpark_at, time.monotonic() + self.PARKED_POLL_S)

    def unpark(self) -> None:
        """Puts parked prompts back at the end of the queue once the pool may have
        changed (lock held).  Jobs behind a parked prompt are never held up by it."""
        if self.parked and (time.monotonic() >= self.unpark_at or self.stopping):
            self.jobs.extend(self.parked)
            self.parked.clear()
            self.unpark_at = float("inf")

    def room_may_have_changed(self) -> None:
        """A release, truncate, expiry or finished prompt may have made room: parked
        prompts look again at the next turn."""
        self.unpark_at = 0.0
