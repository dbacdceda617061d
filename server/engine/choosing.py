"""Token choice in the forward: the rows of a forward that ask the server to choose
(a decode's row, a prompt's last row), chosen in one batched step after the LM head
(``choice.sampling``) or across the ranks' vocabulary slices (``parallel.choice``).
A row that cannot be served fails its own call only."""

from __future__ import annotations

import logging

import torch

from ferrum_rpc.errors import ExecutorError, NonFiniteLogits
from ..choice.sampling import choose_tokens
from ..choice.shaping import reads_history
from ..parallel.choice import RowRequest
from .forward import Step

log = logging.getLogger(__name__)


def asking(steps: list[Step]):
    """(row, step, choice, position, prompt, output) for each row of this forward that
    asks for a token choice (a decode's row, a prompt's last row).  The same before
    the appends are committed (a tensor-parallel plan) as after: the position is the
    new length, the histories the sequence's tokens then, split into prompt and
    output at ``SequenceState.output_start`` (a prompt's own row: all prompt)."""
    at = 0
    for step in steps:
        n = step.rows.count(len(step.tokens))
        if step.choice is not None and n:
            seq, c = step.seq, step.choice
            length = step.start + len(step.tokens)
            prompt, output = (), ()
            if reads_history(c):
                tokens = seq.tokens[:step.start] + list(step.tokens)
                split = length if step.prompt else min(seq.prompt_spans[-1][1], length) if seq.prompt_spans else 0
                prompt, output = tokens[:split], tokens[split:length]
            yield at + n - 1, step, c, length, prompt, output
        at += n


def choice_requests(steps: list[Step]) -> list:
    """The rows asking for a choice, as the tensor-parallel ranks receive them."""
    return [RowRequest.of(row, c, position, prompt, output)
            for row, _, c, position, prompt, output in asking(steps)]


def choose(steps: list[Step], logits: torch.Tensor | None, chosen=None) -> None:
    """Token choice: one ``choose_tokens`` over every row of this forward
    that asks for one (see :func:`asking`); ``chosen``: already chosen across the
    ranks (tensor parallel), in the same order."""
    rows_asking = list(asking(steps))
    if not rows_asking:
        return
    if chosen is None:
        rows = [a[0] for a in rows_asking]
        picked = logits[torch.tensor(rows, device=logits.device)] if len(rows) < logits.shape[0] else logits
        if picked.dtype != torch.float32 or picked.device.type != "cpu":
            picked = picked.float().cpu()
        try:
            chosen = choose_tokens(picked, [a[2] for a in rows_asking], [a[3] for a in rows_asking],
                                   [a[4] for a in rows_asking], [a[5] for a in rows_asking])
        except Exception:
            if len(rows_asking) == 1:
                raise
            log.exception("token choice failed over %d rows; choosing each row alone", len(rows_asking))
            return _choose_alone(rows_asking, picked)
    for i, (_, step, *_) in enumerate(rows_asking):
        if i in chosen.failed:
            step.failure = _non_finite(step)
        else:
            step.chosen = chosen.row(i)


def _choose_alone(rows_asking: list, picked: torch.Tensor) -> None:
    """Token choice row by row, after a batched choice raised: a row whose own
    choice fails fails its own call only."""
    for i, (_, step, c, position, prompt, output) in enumerate(rows_asking):
        try:
            chosen = choose_tokens(picked[i:i + 1], [c], [position], [prompt], [output])
        except Exception as exc:
            step.failure = ExecutorError(f"token choice failed: {type(exc).__name__}: {exc}")
            continue
        if chosen.failed:
            step.failure = _non_finite(step)
        else:
            step.chosen = chosen.row(0)


def _non_finite(step: Step) -> NonFiniteLogits:
    return NonFiniteLogits(f"the model's logits after position {step.start + len(step.tokens) - 1} of "
                           "the sequence are not finite (NaN or infinity); no token can be chosen: "
                           "truncate the sequence before the bad state or release it")
