"""The scheduling policy: which queued work shares the next forward.

Pure functions over a snapshot of the queue: no torch, no threads, no clocks, so
the policy is unit-tested on its own (``tests/unit/engine/test_scheduling_policy.py``).  The
scheduler (``scheduler.py``) takes the snapshot under the queue's lock, asks these
functions, and turns what they chose into a step plan.

The policy, in the order a forward is filled (see ``worker.py``'s docstring
for why):

- the window: only the run of decodes and prompts at the head of the queue;
  any other job (a truncate, fork, release) ends it and is never overtaken;
- decodes first, round-robin by tenant (the tenant with the fewest seats in
  the forward first, each tenant's in arrival order), never a sequence twice,
  never a sequence a prompt queued ahead of it still continues;
- then prompt parts up to the room the token budget leaves, round-robin by
  tenant (the tenant whose prompts were served longest ago first);
- admission: a prompt starts only if the pool can hold the whole of it beside
  the prompts already started; otherwise it is parked (it waits) unless its
  patience ran out.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field


class Kind(enum.Enum):
    DECODE = "decode"
    PROMPT = "prompt"  # a prompt run in parts with other work
    OTHER = "other"  # anything else: ends the window


@dataclass(frozen=True)
class Queued:
    """One queued job as the policy sees it.

    ``key`` is the worker's handle on the job.  DECODE: ``sequences`` are its
    sequences (one seat each).  PROMPT: ``sequences`` holds the sequence it
    continues (empty for a new one), ``remaining`` its tokens left,
    ``started`` whether a part of it ran, ``blocks_to_finish`` the KV blocks
    it still needs; ``must_run`` if it may not wait for room at all (its
    caller left, or the server drains), ``patient`` while its own admission
    wait has not run out (it waits beyond that only while started prompts
    run)."""

    key: int
    kind: Kind
    tenant: str = ""
    sequences: tuple[str, ...] = ()
    remaining: int = 0
    started: bool = False
    blocks_to_finish: int = 0
    must_run: bool = False
    patient: bool = True
    analysis: bool = False  # PROMPT asking for hidden states: its parts run in forwards of their own

    @property
    def continues(self) -> str | None:
        return self.sequences[0] if self.kind is Kind.PROMPT and self.sequences else None


@dataclass(frozen=True)
class Limits:
    max_batch: int  # sequences in one forward
    step_token_budget: int  # 0: prompts and decodes in separate forwards
    prefill_chunk: int  # most tokens of one prompt part


@dataclass
class PromptPlan:
    parts: list[tuple[int, int]] = field(default_factory=list)  # (key, tokens) in the order taken
    parked: list[int] = field(default_factory=list)  # keys of prompts that wait for room


def window(queue: list[Queued], decodes: bool, prompts: bool) -> list[Queued]:
    """The run of decodes and/or prompts at the head of the queue."""
    out = []
    for q in queue:
        if not ((decodes and q.kind is Kind.DECODE) or (prompts and q.kind is Kind.PROMPT)):
            break
        out.append(q)
    return out


def take_decodes(queue: list[Queued], batch: list[Queued], limits: Limits) -> tuple[list[Queued], bool]:
    """Queued decodes that join ``batch``, fairly across tenants, and whether the batch
    is closed (full, a job that does not fit, or the window ends before the queue)."""
    size = sum(len(q.sequences) for q in batch)
    if size >= limits.max_batch:
        return [], True
    win = window(queue, decodes=True, prompts=limits.step_token_budget > 0)  # 0: decodes alone
    closed = len(win) < len(queue)
    by_tenant: dict[str, deque[Queued]] = {}
    busy: dict[int, set[str]] = {}  # per decode: sequences continued by prompts queued ahead of it
    ahead: set[str] = set()
    for q in win:
        if q.kind is Kind.DECODE:
            by_tenant.setdefault(q.tenant, deque()).append(q)
            busy[q.key] = set(ahead)
        elif q.continues is not None:
            ahead.add(q.continues)
    seats = {t: sum(1 for q in batch if q.tenant == t) for t in by_tenant}
    seen = {s for q in batch for s in q.sequences}
    taken: list[Queued] = []
    while size < limits.max_batch:
        ready = [t for t, pending in by_tenant.items() if pending]
        if not ready:
            break
        tenant = min(ready, key=lambda t: seats[t])  # ties: the earliest arrival
        q = by_tenant[tenant][0]
        if (size + len(q.sequences) > limits.max_batch or not seen.isdisjoint(q.sequences)
                or not busy[q.key].isdisjoint(q.sequences)):
            del by_tenant[tenant]  # its later jobs wait behind this one
            closed = True
            continue
        by_tenant[tenant].popleft()
        taken.append(q)
        seen.update(q.sequences)
        seats[tenant] += 1
        size += len(q.sequences)
    return taken, closed or size >= limits.max_batch or any(by_tenant.values())


def prompt_room(limits: Limits, decode_rows: int, decoders_active: bool) -> int:
    """Prompt tokens this forward may carry beside ``decode_rows`` decodes."""
    if limits.step_token_budget == 0:  # separate forwards: prompts only when no decode runs
        return 0 if decode_rows else limits.prefill_chunk
    budget = limits.step_token_budget
    if decode_rows:
        return max(budget - decode_rows, budget // 4, 1)  # prompts progress every step
    if decoders_active:
        # decoders are between calls (their replies are on the way back): a budget-sized
        # forward lets their next calls join the next forward instead of waiting out a chunk
        return budget
    return max(budget, limits.prefill_chunk)  # nobody is decoding: prompts run whole chunks


def fair(prompts: list[Queued], turns: dict[str, int]) -> list[Queued]:
    """Prompts in the order they get parts: round-robin across tenants, the tenant
    served longest ago first (``turns``: tenant -> when it was last served), each
    tenant's in queue order."""
    by_tenant: dict[str, list[Queued]] = {}
    for q in prompts:
        by_tenant.setdefault(q.tenant, []).append(q)
    tenants = sorted(by_tenant, key=lambda t: turns.get(t, -1))
    rounds = max((len(v) for v in by_tenant.values()), default=0)
    return [by_tenant[t][i] for i in range(rounds) for t in tenants if i < len(by_tenant[t])]


def take_prompts(queue: list[Queued], decodes: list[Queued], limits: Limits, room: int, free_blocks: int,
                 turns: dict[str, int]) -> PromptPlan:
    """The prompt parts of this forward (never a sequence twice), and the prompts
    parked because the pool cannot hold them beside the started ones."""
    win = window(queue, decodes=limits.step_token_budget > 0, prompts=True)
    seen = {s for q in decodes for s in q.sequences}
    started = sum(q.blocks_to_finish for q in queue if q.kind is Kind.PROMPT and q.started and not q.analysis)
    free = free_blocks - started  # room not yet promised to started prompts
    plan = PromptPlan()
    for q in fair([q for q in win if q.kind is Kind.PROMPT and not q.analysis], turns):
        if room <= 0:
            break
        seq = q.continues or f"new:{q.key}"
        if seq in seen:
            continue
        if not q.started:
            if q.blocks_to_finish > free and not q.must_run and (started or q.patient):
                plan.parked.append(q.key)
                continue
            free -= q.blocks_to_finish
            started += q.blocks_to_finish
        seen.add(seq)
        part = min(q.remaining, room, limits.prefill_chunk)
        plan.parts.append((q.key, part))
        room -= part
    return plan


def still_waiting_for(recent: set[str], batch: list[Queued], queue: list[Queued]) -> bool:
    """Whether a recent decoder is neither in ``batch`` nor busy with a queued
    continuation prompt (it cannot decode before that is done): the worker waits
    briefly for such decoders' next calls."""
    present = {s for q in batch for s in q.sequences}
    present |= {q.continues for q in queue if q.continues is not None}
    return not present >= recent
