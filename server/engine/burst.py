"""Bursts: several forwards of decode rows with none of the engine's per-forward
bookkeeping between them.

Between two forwards of a plain decode step the engine plans (resolves, reserves),
builds the KV view and the token ids, chooses, commits and builds the outputs.  Each
of those ops runs on caches that the forward's weights have just streamed through
(``bench.engine_overhead`` measures what they add).  When a forward's only rows are
decode-ahead rows whose choices read no history (no penalties), the worker
(``runs.py``) runs up to ``k`` forwards as one burst:

- the room for all k tokens is reserved at once, inside each sequence's current KV
  block: the same blocks and the same copies that k single steps would reserve;
- the KV view moves on in place (``KvBatch.next_position``) and the chosen tokens feed
  the next forward as a tensor;
- after the last forward the commits and the outputs follow, forward by forward, as
  the single steps would have made them.

A row's bits are those of a single step: the same model call and LM head, and the
same token choice: ``choose_tokens`` at the row's position (its seeded draw keyed by
it), or for rows all greedy and plain the fused pass ``choose_tokens`` itself takes
for them (``choose_plain_greedy``).  A forward with a row that cannot be chosen for
(not finite) does not count: the burst ends before it, and the worker runs it as a
plain step, which fails that row's call alone.
"""

from __future__ import annotations

import time

import torch

from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.types import ChosenToken, DecodeInput, DecodeOutput, Timing
from ..choice.rows import greedy_op_loaded
from ..choice.sampling import choose_plain_greedy, choose_tokens, plain_choice
from ..choice.shaping import reads_history
from ..kv.blocks import SequenceState, WritePlan


def bursts_serve(executor, item: DecodeInput) -> bool:
    """Whether a burst can run ``item``'s row on ``executor``: a choice that reads no
    history (no repetition, presence or frequency penalty: the row's logits, the choice
    and the position decide), no adapter (as its handle says; ``Burst.open`` checks the
    sequence), on one CPU process (no tensor-parallel ranks, no captured graphs)."""
    choice = item.token_choice
    return (choice is not None and not reads_history(choice) and not item.kv_cache.adapter
            and executor.runner is None and executor.graphs is None and executor.device.type == "cpu")


class Burst:
    """Up to ``forwards`` forwards of one-token steps of ``inputs``' sequences.  Built by
    :meth:`open`; :meth:`forward` runs the next forward, :meth:`commit` makes one
    forward's outputs, :meth:`release_unused` gives back what no commit uses."""

    def __init__(self, ex, inputs: list[DecodeInput], seqs: list[SequenceState], plans: list[WritePlan],
                 forwards: int):
        self.ex, self.inputs, self.seqs, self.plans, self.forwards = ex, inputs, seqs, plans, forwards
        self.starts = [seq.length for seq in seqs]
        self.kv = ex.pool.batch([seq.block_ids for seq in seqs], self.starts, [1] * len(seqs))
        self.ids = torch.tensor([[item.token_id] for item in inputs], dtype=torch.int64, device=ex.pool.k.device)
        self.choices = [item.token_choice for item in inputs]
        # every row greedy and plain: the fused greedy pass alone, as choose_tokens takes it for such rows
        self.greedy = all(c.is_greedy and plain_choice(c) for c in self.choices) and greedy_op_loaded()
        self.tokens: list[list[int]] = []  # each forward's chosen token per row
        self.chosen: list[list[ChosenToken]] = []
        self.ns: list[int] = []
        self.committed = [0] * len(seqs)  # forwards committed per row
        self._chosen_ids: torch.Tensor | None = None  # the last forward's choices, (B,)

    @classmethod
    def open(cls, ex, inputs: list[DecodeInput], tenants: list[str], forwards: int) -> Burst | None:
        """Validates the rows as a plain decode step would and reserves room for up to
        ``forwards`` tokens each, fewer where a sequence's current block or its maximum
        length ends first.  None, with nothing reserved, where a burst of at least two
        forwards cannot run them: a row that fails validation or reservation (a plain
        step gives its call that error), an adapter's sequence, or too little room."""
        try:
            for item in inputs:
                ex.check_token_choice(item.token_choice)
            ex.checks.tokens([item.token_id for item in inputs])
            seqs = [ex.checks.resolve(item.kv_cache, tenant) for item, tenant in zip(inputs, tenants)]
        except ExecutorError:
            return None
        bs = ex.kv.block_size
        forwards = min(forwards, *(bs - seq.length % bs for seq in seqs), *(ex.max_seq_len - seq.length for seq in seqs))
        if (forwards < 2 or any(seq.adapter for seq in seqs)
                or len({seq.cache_id for seq in seqs}) != len(seqs)):
            return None
        plans: list[WritePlan] = []
        try:
            for seq in seqs:
                plans.append(ex.reserve(seq, forwards))
        except ExecutorError:
            for seq, plan in zip(seqs, plans):
                ex.kv.undo_write(seq, plan)
            return None
        return cls(ex, inputs, seqs, plans, forwards)

    @property
    def done(self) -> int:
        """Forwards run and counted."""
        return len(self.tokens)

    def forward(self) -> list[int] | None:
        """Runs the next forward: each row's chosen token, or None (nothing of it counts)
        when a row cannot be chosen for (not finite, or the batched choice raised: a
        plain step then fails that row's call alone)."""
        t0 = time.perf_counter_ns()
        model = self.ex.model
        with torch.inference_mode():
            if self.tokens:  # the last forward's choices at the next positions
                self.kv.next_position()
                self.ids.view(-1).copy_(self._chosen_ids)
            hidden = model(self.ids, self.kv.positions, self.kv)
            logits = model.logits(hidden.reshape(-1, hidden.shape[-1]))
        if logits.dtype != torch.float32:  # bursts run on the CPU only (bursts_serve)
            logits = logits.float()
        chosen = choose_plain_greedy(logits) if self.greedy else None
        if chosen is None:  # the step a plain forward takes: the same call, at each row's position
            try:
                chosen = choose_tokens(logits, self.choices, [start + self.done + 1 for start in self.starts])
            except Exception:
                return None
            if chosen.failed:
                return None
        ns = time.perf_counter_ns() - t0
        rows = len(self.seqs)
        self.ex.stats.count_forward(True, ns, rows, rows)
        self.ex.stats.burst_forwards += 1
        self._chosen_ids = chosen.token_ids
        self.tokens.append(chosen.token_ids.tolist())
        self.chosen.append(chosen.rows())
        self.ns.append(ns)
        return self.tokens[-1]

    def commit(self, f: int, rows: range) -> list[DecodeOutput]:
        """Commits forward ``f``'s token of each of ``rows`` (every earlier forward of
        theirs committed first) and returns their outputs, as a plain step's."""
        timing = Timing(forward_ns=self.ns[f], batch_size=len(self.seqs))
        outs = []
        for r in rows:
            seq = self.seqs[r]
            self.ex.kv.commit(seq, self.starts[r] + f, [self.inputs[r].token_id if f == 0 else self.tokens[f - 1][r]])
            self.committed[r] += 1
            outs.append(DecodeOutput(None, self.ex.handle(seq), timing, chosen=self.chosen[f][r]))
        return outs

    def release_unused(self) -> None:
        """Gives back the room of rows with nothing committed.  A row with a commit uses
        its reservation: it lies in the block the first token went to."""
        for r, (seq, plan) in enumerate(zip(self.seqs, self.plans)):
            if not self.committed[r]:
                self.ex.kv.undo_write(seq, plan)
                self.committed[r] = -1  # given back once
