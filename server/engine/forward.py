"""One forward over any mix of steps: each step a sequence's new tokens after its
end (a decode's one token, a prompt's part), run as one padded (B, T) batch or
ragged, then one LM-head GEMM over just the rows the steps ask for."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from ..kv.pool import KvPool, RaggedBatch
from ..kv.blocks import SequenceState, WritePlan
from ..models.lora import BASE
from ferrum_rpc.types import ChosenToken, LogitsPolicy, TokenChoice
from .opened import Opened


class Rows(enum.Enum):
    """Which of a step's hidden rows go through the LM head."""

    ALL = "all"  # every position (ForwardVerify, a prompt asking for all positions)
    LAST = "last"  # the last one (a decode, a prompt's last part)
    NONE = "none"  # none (a prompt's earlier parts)

    def count(self, tokens: int) -> int:
        return tokens if self is Rows.ALL else 1 if self is Rows.LAST else 0


@dataclass
class Step:
    """One sequence's part of a forward: ``tokens`` written from position ``start``."""

    opened: Opened  # the call it belongs to: a failure puts the sequence back to that
    tokens: list[int]
    start: int
    plan: WritePlan  # the KV room reserved for it
    rows: Rows
    # analysis: layer -> this step's hidden states (T, C), filled by run() for the layers asked
    hidden: dict[int, torch.Tensor | None] | None = None
    # analysis: decoder layer -> this step's attention weights (H, T, start + T) of the heads asked
    attention: dict[int, torch.Tensor | None] | None = None
    heads: tuple[int, ...] = ()
    # token choice: the policy choosing the token after this step's last row
    # (a decode, a prompt's final part), and what run() chose
    choice: TokenChoice | None = None
    chosen: ChosenToken | None = None
    failure: Exception | None = None  # this row could not be served: its call alone fails
    logits: bool = True  # its rows go back as logits (False: a chosen token only)
    prompt: bool = False  # a Prefill's part: the sequence's tokens are all prompt for the penalties

    @property
    def seq(self) -> SequenceState:
        return self.opened.seq

    @property
    def adapter(self) -> str:
        """The LoRA adapter its sequence runs with ("" = the base model)."""
        return self.seq.adapter

    @property
    def block_ids(self) -> list[int]:
        """The blocks the forward reads and writes (a tensor-parallel plan carries these)."""
        return self.seq.block_ids


def forward(model: torch.nn.Module, pool: KvPool, steps: list[Step]) -> torch.Tensor | None:
    """One forward over every step, then the LM head over the rows they ask for:
    (rows, V) logits in step order (``Rows.count`` rows each), or None if no step asks."""
    hidden, firsts = _hidden(model, pool, steps)  # (N, C), each step's first row
    if hidden.shape[0] == 1:  # one step of one token: its row, if asked for, is hidden itself (no slice)
        picked = [hidden] if steps[0].rows in (Rows.ALL, Rows.LAST) else []
    else:
        picked = []
        for first, step in zip(firsts, steps):
            n = len(step.tokens)
            if step.rows is Rows.ALL:
                picked.append(hidden[first:first + n])
            elif step.rows is Rows.LAST:
                picked.append(hidden[first + n - 1:first + n])
    if not picked:
        return None
    with torch.inference_mode():
        return model.logits(torch.cat(picked) if len(picked) > 1 else picked[0])


def _hidden(model: torch.nn.Module, pool: KvPool, steps: list[Step]) -> tuple[torch.Tensor, list[int]]:
    """Hidden states (N, C) of every step and each step's first row in them (its rows
    are the next ``len(step.tokens)``).  Steps of one length run as one (B, T)
    batch (the decode fast path, fused whole-layer ops included); steps of mixed
    lengths (decodes beside prompt chunks) run ragged, each length a group, no
    token padded (see ``RaggedBatch``).  Steps that ask for hidden states of some
    layers get their rows of those (they run alone or with equal-length steps:
    the worker sees to it)."""
    counts = [len(s.tokens) for s in steps]
    if len(set(counts)) > 1 and not any(s.hidden or s.attention for s in steps):
        return _ragged(model, pool, steps)
    if any(s.adapter for s in steps) and not any(s.hidden or s.attention for s in steps):
        order = sorted(range(len(steps)), key=lambda i: _slot(model, steps[i]))
        if order != list(range(len(steps))):  # rows grouped by adapter: each group's product on contiguous rows
            hidden, firsts = _hidden(model, pool, [steps[i] for i in order])
            placed = [0] * len(steps)
            for position, i in enumerate(order):
                placed[i] = firsts[position]
            return hidden, placed
    width = max(counts)
    device = pool.k.device
    kv = pool.batch([s.block_ids for s in steps], [s.start for s in steps], counts)
    ids = torch.tensor([s.tokens + [0] * (width - len(s.tokens)) for s in steps], device=device)
    layers = {layer for s in steps if s.hidden for layer in s.hidden}
    capture = dict.fromkeys(layers) if layers else None
    if attention := {layer for s in steps if s.attention for layer in s.attention}:
        kv.attention = dict.fromkeys(attention)
    slots = _adapter_slots(model, steps, [1] * len(steps))  # one per sequence: (B,)
    with torch.inference_mode():
        if slots is not None:
            out = model(ids, kv.positions, kv, capture, adapter_slots=slots)
        else:
            out = model(ids, kv.positions, kv, capture) if capture else model(ids, kv.positions, kv)
    for b, step in enumerate(steps):
        for layer in step.hidden or ():
            step.hidden[layer] = capture[layer][b, :counts[b]].float().cpu()
        heads = list(step.heads) or slice(None)
        for layer in step.attention or ():  # keys past the sequence's end are padding: dropped
            step.attention[layer] = kv.attention[layer][b, heads, :counts[b], :step.start + counts[b]].cpu()
    return out.reshape(-1, out.shape[-1]), [b * width for b in range(len(steps))]


def _ragged(model: torch.nn.Module, pool: KvPool, steps: list[Step]) -> tuple[torch.Tensor, list[int]]:
    by_length: dict[int, list[int]] = {}
    for i in sorted(range(len(steps)), key=lambda i: _slot(model, steps[i])):  # adapters' rows together
        by_length.setdefault(len(steps[i].tokens), []).append(i)
    groups, ids, firsts, order = [], [], [0] * len(steps), []
    for width, members in by_length.items():
        groups.append(([steps[i].block_ids for i in members], [steps[i].start for i in members], width))
        for i in members:
            firsts[i] = len(ids)
            ids.extend(steps[i].tokens)
            order.append(i)
    kv = RaggedBatch(pool, groups)
    slots = _adapter_slots(model, [steps[i] for i in order], [len(steps[i].tokens) for i in order])
    with torch.inference_mode():
        ids = torch.tensor([ids], device=pool.k.device)
        out = model(ids, None, kv) if slots is None else model(ids, None, kv, adapter_slots=slots[None])  # (1, N, C)
    return out[0], firsts


def _adapter_slots(model: torch.nn.Module, steps: list[Step], repeats: list[int]) -> torch.Tensor | None:
    """Each step's LoRA adapter slot (``models/lora.py``), ``repeats[i]`` times for step i,
    in order; None when every step runs the base model (the forward then takes no adapter path)."""
    if not any(step.adapter for step in steps):
        return None
    slots = [_slot(model, step) for step in steps]
    return torch.tensor(slots, dtype=torch.int64).repeat_interleave(torch.tensor(repeats))


def _slot(model: torch.nn.Module, step: Step) -> int:
    """The adapter slot a step runs with (BASE: the base model)."""
    return model.adapters.slot(step.adapter) if step.adapter else BASE


class PlanKind(enum.Enum):
    """What a plan's result is (see :meth:`TorchExecutor.run`)."""

    DECODE = "decode"  # a DecodeOutput per step
    PART = "part"  # a prompt's part (one step): its float32 logits rows, or None when it asked for none


@dataclass
class AppendPlan:
    """Validated appends whose KV room is reserved: ``TorchExecutor.run`` runs any
    number of plans (decodes, prompts' parts) as one forward."""

    steps: list[Step]
    policy: LogitsPolicy
    kind: PlanKind
