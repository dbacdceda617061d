"""The runner: executes a :class:`~.scheduler.StepPlan` as one forward and answers
every job in it.

Each decode and each prompt part is planned on the executor first (a job whose
plan fails gets its error alone), then all run as one forward.  Then each job is
committed or undone: a decode's caller gets its result, a prompt's part is
recorded (an unfinished prompt goes back in the queue), and a job whose caller
went away during the forward, or whose own rows failed, has what it changed put
back.  A call (a truncate, a fork, a release) runs alone (:meth:`Runner.call`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from ferrum_rpc.errors import ExecutorError, RequestIdBusy
from .jobs import Job, with_queue_time
from .queue import WorkQueue
from .scheduler import StepPlan, StepResult

if TYPE_CHECKING:
    from .executor import TorchExecutor

log = logging.getLogger(__name__)


class Runner:
    def __init__(self, queue: WorkQueue, executor: TorchExecutor):
        self.queue, self.executor = queue, executor

    def call(self, job: Job) -> None:
        """Runs a call's ``fn(*args)`` and answers it."""
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

    def run(self, plan: StepPlan) -> StepResult:
        """Plans every decode and prompt part, runs them all as one forward, and hands
        each decode its result and each prompt its part's."""
        start = time.perf_counter_ns()
        planned: list[tuple[Job, Any]] = []
        for job in plan.decodes:
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
        for job, tokens in plan.prompts:
            if (part := self._plan_part(job, tokens)) is not None:
                planned.append((job, part))
        if not planned:
            return StepResult(None)
        t0 = time.perf_counter_ns()
        try:
            results = self.executor.run([p for _, p in planned])
        except BaseException as exc:  # run() put every sequence back; prompts undo their earlier parts
            if not isinstance(exc, ExecutorError):
                log.exception("batched forward failed")
            for job, _ in planned:
                if job.prompt is not None:
                    job.prompt.abandon()
                job.future.set_exception(exc)
            return StepResult(None)
        forward_ns, steps = time.perf_counter_ns() - t0, sum(len(p.steps) for _, p in planned)
        decoded = tuple(item.kv_cache.cache_id for job in plan.decodes if job.run is None  # a run's rows are always in
                        for item in job.decode.inputs)
        for (job, part), result in zip(planned, results):
            self._settle(job, part, result, start, forward_ns, steps)
        return StepResult(forward_ns, decoded)

    def _settle(self, job: Job, part: Any, result: Any, start: int, forward_ns: int, steps: int) -> None:
        """Commits one job's share of the forward, or undoes it."""
        if not isinstance(result, BaseException) and (gone := job.gone()) is not None:
            # its caller stopped waiting during the forward: what it committed goes back
            if job.decode:
                self.executor.undo(job.decode.undo_records(result))
            result = gone
        if isinstance(result, BaseException):  # this call's own rows failed; run() undid it
            if job.prompt is not None:
                job.prompt.abandon()
            job.future.set_exception(result)
            return
        if job.decode:
            job.future.set_result(with_queue_time(result, start - job.enqueued_ns))
            return
        try:
            done = job.prompt.part_done(part, result, forward_ns, steps)
        except BaseException as exc:
            job.future.set_exception(exc)
            return
        if done is None:
            self.queue.requeue(job)
        else:
            job.future.set_result(with_queue_time(done, job.queue_ns))

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
                job.prompt.abandon()
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
            with self.queue.cond:
                self.queue.jobs.append(job)
                self.queue.park(job)
            return None
        except BaseException as exc:
            if job.prompt is not None:
                job.prompt.abandon()
            job.future.set_exception(exc)
            return None
