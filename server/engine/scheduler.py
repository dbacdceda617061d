"""The scheduler: what the next forward runs, as a frozen :class:`StepPlan`.

It reads the queue (``queue.py``) and the block manager's free blocks, asks the
policy (``policy.py``, pure functions) which decodes and prompt parts share the
forward, parks the prompts the pool cannot hold yet, and keeps what the policy
needs to remember between forwards: which sequences decoded in the last second,
how long the last forward took, which tenant's prompts were served last.  The
runner (``runner.py``) executes the plan; the worker's loop hands the result back
here (:meth:`Scheduler.ran`)."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ferrum_rpc.errors import ExecutorError
from . import policy
from .jobs import Job
from .queue import WorkQueue

if TYPE_CHECKING:
    from .executor import TorchExecutor


@dataclass(frozen=True)
class StepPlan:
    """One forward's work: the decode jobs (decode-ahead runs' included), then each
    prompt taking a part, with the most tokens that part may run."""

    decodes: tuple[Job, ...]
    prompts: tuple[tuple[Job, int], ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What a plan's forward did: its time (None: nothing ran, every job failed on its
    own), and the sequences of callers that decode one call a step (the runs' rows
    are left out: they are always in)."""

    forward_ns: int | None
    decoded: tuple[str, ...] = ()


class Scheduler:
    ADMISSION_WAIT_S = 2.0  # how long a prompt the pool cannot hold waits for other sequences to go
    DECODERS_ACTIVE_S = 1.0  # a decode forward this recent means decoders are active (see take_prompts)

    def __init__(self, queue: WorkQueue, executor: TorchExecutor, batch_wait_s: float = 0.0):
        self.queue, self.executor = queue, executor
        self.kv = executor.kv  # the block manager: how much room prompts have
        self.batch_wait_s = batch_wait_s
        self.decoded_at = float("-inf")  # when the last forward with decodes ran
        self.decoders: dict[str, float] = {}  # sequence -> when it last decoded (the last second's)
        self.last_forward_s = 0.0  # how long the last forward with decodes took
        self._prompt_turns: dict[str, int] = {}  # tenant -> when its prompts last got a part (see policy.fair)
        self._turns = itertools.count()

    # -- the plan ----------------------------------------------------------------
    def plan(self, decodes: list[Job]) -> StepPlan:
        """The next forward for ``decodes`` (taken from the queue already): more
        decodes if they come within the batching window, then the prompt parts that
        fit beside them."""
        if decodes and self.batch_wait_s:
            self._wait_for_more(decodes)
        elif self.executor.config.step_token_budget:
            self._wait_for_decoders(decodes)
        with self.queue.cond:
            prompts = self._take_prompts(decodes)
        return StepPlan(tuple(decodes), tuple(prompts))

    def ran(self, plan: StepPlan, result: StepResult) -> None:
        """Remembers a forward with decodes: when, how long, and who decoded."""
        if result.forward_ns is None or not plan.decodes:
            return
        self.decoded_at = now = time.monotonic()
        self.last_forward_s = result.forward_ns / 1e9
        for cid in result.decoded:
            self.decoders[cid] = now

    def burst_ran(self, last_forward_ns: int) -> None:
        """A burst of decode-ahead forwards ended (``runs.py``)."""
        self.decoded_at, self.last_forward_s = time.monotonic(), last_forward_ns / 1e9

    def unary_decoders_active(self) -> bool:
        """A caller decoding one call a step did so within the last second."""
        now = time.monotonic()
        return any(now - t <= self.DECODERS_ACTIVE_S for t in self.decoders.values())

    def collect(self, batch: list[Job]) -> bool:
        """Moves queued decodes into ``batch`` while they fit (lock held), fairly
        across tenants (``policy.take_decodes``).  Returns True if the batch is
        closed (full, a job that does not fit, or the window ends before the queue does)."""
        if not self.queue.jobs:  # nothing queued (a run decoding ahead alone): closed only when full
            return sum(len(j.decode.inputs) for j in batch) >= self.executor.config.max_batch_size
        queue, jobs = self._snapshot()
        taken, closed = policy.take_decodes(queue, [self._view(j) for j in batch], self._limits())
        batch.extend(jobs[q.key] for q in taken)
        self.queue.remove([jobs[q.key] for q in taken])
        return closed

    # -- the policy over a snapshot of the queue -----------------------------------
    def _limits(self) -> policy.Limits:
        cfg = self.executor.config
        return policy.Limits(cfg.max_batch_size, cfg.step_token_budget, cfg.prefill_chunk)

    def _view(self, job: Job | None) -> policy.Queued:
        """How the policy sees a queued job (lock held)."""
        if job is None or not (job.decode or job.prefill):
            return policy.Queued(id(job), policy.Kind.OTHER)
        if job.decode:
            return policy.Queued(id(job), policy.Kind.DECODE, job.tenant,
                                 tuple(i.kv_cache.cache_id for i in job.decode.inputs))
        seq = job.sequence()
        patient = job.parked_at is None or time.monotonic() - job.parked_at < self.ADMISSION_WAIT_S
        return policy.Queued(
            id(job), policy.Kind.PROMPT, job.tenant, (seq,) if seq is not None else (),
            remaining=job.prompt.remaining if job.prompt is not None else len(job.prefill.token_ids),
            started=job.prompt is not None, blocks_to_finish=self._blocks_to_finish(job),
            must_run=self.queue.stopping or job.gone() is not None or self._never_fits(job), patient=patient,
            analysis=job.analysis)

    def _snapshot(self) -> tuple[list[policy.Queued], dict[int, Job]]:
        jobs = self.queue.jobs
        return [self._view(j) for j in jobs], {id(j): j for j in jobs if j is not None}

    def _take_prompts(self, decodes: list[Job]) -> list[tuple[Job, int]]:
        """Takes the prompts that get a part of this forward and how many tokens each
        may run, and parks those the pool cannot hold yet (lock held; see policy.py)."""
        if not self.queue.jobs:  # no prompt queued: none to take or park
            return []
        limits = self._limits()
        rows = sum(len(j.decode.inputs) for j in decodes)
        active = time.monotonic() - self.decoded_at < self.DECODERS_ACTIVE_S
        queue, jobs = self._snapshot()
        plan = policy.take_prompts(queue, [self._view(j) for j in decodes], limits,
                                   policy.prompt_room(limits, rows, active), self.kv.num_free, self._prompt_turns)
        for key in plan.parked:
            self.queue.park(jobs[key])
        taken = [(jobs[key], tokens) for key, tokens in plan.parts]
        self.queue.remove([job for job, _ in taken])
        for job, _ in taken:
            self._prompt_turns[job.tenant] = next(self._turns)
        return taken

    def _blocks_to_finish(self, job: Job) -> int:
        """KV blocks a prompt still needs to finish (an upper bound: a cached prefix
        may need fewer; a continuation that starts inside a shared block one more)."""
        kv = self.kv
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

    # -- waiting for the batch to fill ---------------------------------------------
    def _wait_for_more(self, batch: list[Job]) -> None:
        deadline = time.monotonic() + self.batch_wait_s
        with self.queue.cond:
            while not self.collect(batch) and (left := deadline - time.monotonic()) > 0:
                self.queue.cond.wait(left)

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
        # A released (or expired, or moved) sequence never calls again: waiting for it would
        # cost every other decoder a quarter of a forward per step for a second.
        for cid in [c for c, t in self.decoders.items() if now - t > self.DECODERS_ACTIVE_S or c not in self.kv]:
            del self.decoders[cid]
        if not self.decoders:
            return
        deadline = now + min(0.25 * self.last_forward_s, 0.05)
        with self.queue.cond:
            while not self.collect(batch) and (left := deadline - time.monotonic()) > 0:
                if not policy.still_waiting_for(set(self.decoders), [self._view(j) for j in batch],
                                                [self._view(j) for j in self.queue.jobs]):
                    return
                self.queue.cond.wait(left)
