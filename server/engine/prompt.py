"""A prompt run in parts, each part one step of a forward that may carry other
work (decodes, other prompts' parts): the unified forward.  Uses the
executor's planning interface (``PartPlanner``: ``plan_part``, ``undo``; the worker runs the plans)."""

from __future__ import annotations

from typing import Iterable, Protocol

import torch
import torch.nn.functional as F

from ferrum_rpc.types import HiddenStatesRequest, LogitsPolicy, PrefillOutput, Timing, TokenChoice
from .forward import AppendPlan, Rows
from .opened import Opened
from .undo import Undo
from ..kv.blocks import BlockManager


class PartPlanner(Protocol):
    """The executor's planning interface a prompt in parts uses."""

    kv: BlockManager

    def plan_part(self, opened: Opened, tokens: list[int], rows: Rows, policy: LogitsPolicy) -> AppendPlan:
        """Plans an opened prompt's next ``tokens``, reserving their KV room."""

    def undo(self, undos: Iterable[Undo]) -> None:
        """Puts each record's sequence back as it was before its call."""


class PromptInParts:
    """The worker asks for the next part with the tokens it may take this step
    (:meth:`next_part`, which reserves the part's KV room), runs the plan with
    whatever else shares the forward, and hands back the part's rows
    (:meth:`part_done`), which returns the PrefillOutput after the last part.
    The sequence is pinned meanwhile, so the idle reaper never takes it; if a
    part fails, or the caller goes away between parts, :meth:`undo` undoes
    every part: the sequence is as it was before the call, idle clock
    included.
    """

    def __init__(self, executor: PartPlanner, opened: Opened, tokens: list[int], policy: LogitsPolicy,
                 hidden: HiddenStatesRequest | None, choice: TokenChoice | None = None, want_logits: bool = True,
                 as_output: bool = False):
        self.executor, self.opened, self.tokens, self.policy, self.hidden = executor, opened, tokens, policy, hidden
        # token choice: chosen after the last part; logits only when asked; as_output:
        # the tokens are output for the penalties (verified drafts), else a prompt
        self.choice, self.want_logits, self.as_output = choice, want_logits, as_output
        self.chosen = None
        self.offset = opened.cached  # tokens done (cached prefix included)
        self.rows: list[torch.Tensor] = []
        self.states: dict[int, list[torch.Tensor]] = {layer: [] for layer in (hidden.layers if hidden else ())}
        self.weights: dict[int, list[torch.Tensor]] = {layer: [] for layer in
                                                       (hidden.attention_layers if hidden else ())}
        self.forward_ns = 0
        self.open = True

    @property
    def remaining(self) -> int:
        return len(self.tokens) - self.offset

    @property
    def analysis(self) -> bool:
        """Asks for hidden states: its parts run in forwards of their own."""
        return self.hidden is not None

    def next_part(self, max_tokens: int) -> AppendPlan:
        """Plans the next ``min(max_tokens, remaining)`` tokens (reserving KV room); raises with
        nothing reserved (the caller then undoes the whole prompt)."""
        n = min(max_tokens, self.remaining)
        final = n == self.remaining
        rows = Rows.ALL if self.policy.all_positions else Rows.LAST if final else Rows.NONE
        plan = self.executor.plan_part(self.opened, self.tokens[self.offset:self.offset + n], rows, self.policy)
        (step,) = plan.steps
        step.prompt = not self.as_output
        step.logits = self.want_logits  # a tensor-parallel forward then gathers no whole rows for it
        if final:
            step.choice = self.choice
        step.hidden = dict.fromkeys(self.states) if self.states else None
        if self.weights:
            step.attention, step.heads = dict.fromkeys(self.weights), tuple(self.hidden.attention_heads)
        return plan

    def part_done(self, plan: AppendPlan, rows: torch.Tensor | None,
                  forward_ns: int = 0, batch_size: int = 1) -> PrefillOutput | None:
        """Takes a run part's rows; returns the output once the prompt is complete."""
        (step,) = plan.steps
        self.offset += len(step.tokens)
        self.forward_ns += forward_ns
        if rows is not None:
            self.rows.append(rows)
        if step.chosen is not None:
            self.chosen = step.chosen
        for layer in self.states:
            self.states[layer].append(step.hidden[layer])
        for layer in self.weights:
            self.weights[layer].append(step.attention[layer])
        if self.remaining:
            return None
        ex, hidden = self.executor, self.hidden
        try:
            logits = None
            if self.want_logits:
                logits = ex.apply_policy(torch.cat(self.rows) if len(self.rows) > 1 else self.rows[0], self.policy)
            picked = list(hidden.positions) if hidden and hidden.positions else slice(None)
            states = tuple(torch.cat(self.states[layer])[picked].numpy() for layer in (hidden.layers if hidden else ()))
            length = self.opened.seq.length  # earlier parts saw fewer keys: zero-padded (causal) to all of them
            weights = tuple(torch.cat([F.pad(w, (0, length - w.shape[-1])) for w in self.weights[layer]], dim=1)
                            [:, picked].numpy() for layer in (hidden.attention_layers if hidden else ()))
        except BaseException:
            self.abandon()
            raise
        self.open = False
        if not self.as_output:  # the penalties' prompt now ends here
            ex.kv.mark_prompt(self.opened.seq, self.opened.origin, self.opened.seq.length)
        ex.kv.unpin(self.opened.seq, touch=True)
        return PrefillOutput(logits, ex.handle(self.opened.seq), Timing(forward_ns=self.forward_ns,
                                                                        batch_size=batch_size),
                             cached_tokens=self.opened.cached, hidden_states=states, attention_weights=weights,
                             chosen=self.chosen)

    def abandon(self) -> None:
        """Undoes every part run so far (safe to call twice, and after a failed forward)."""
        if self.open:
            self.open = False
            self.executor.kv.unpin(self.opened.seq, touch=False)
            self.executor.undo([self.opened.undo_record])
