"""Steps 1-2 of token choice, on whole rows or a tensor-parallel rank's slice: the logit
bias, the repetition, presence and frequency penalties, the allowed-token bitmask; and
the logits held finite before any of it (:func:`held_finite`).

:func:`shape_logits` runs the steps on whole rows; a rank applies its slice of the bias
itself and shares :func:`penalise_counts` and :func:`unpack_rows`, so both compute the
same penalised values.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np
import torch

from .masks import allowed_tokens

__all__ = ["LOGIT_LIMIT", "held_finite", "penalise_counts", "shape_logits", "unpack_rows"]

# Logits are held to +-LOGIT_LIMIT before temperature: a repetition penalty may be any finite
# value > 0, and l / 1e-38 overflows float32. At the smallest sampled temperature (1e-5) a
# held logit is 1e35, still finite, so every difference and exp below stays defined.
LOGIT_LIMIT = 1e30


def held_finite(logits: torch.Tensor, low_high=None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(R, V) float32 -> the rows to choose from, and the rows that hold a NaN or an
    infinity.  Those rows are zeroed (every path stays defined on them; their results
    are discarded) and rows past +-LOGIT_LIMIT are held to it: a row's max and min, and a
    copy only when some row needs either.  amax and amin, not aminmax: ATen's aminmax
    over the last dim is several times slower on the CPU.  ``low_high``: each row's
    smallest and largest, where the caller has them (both NaN for a row holding a NaN)."""
    low, high = low_high or (logits.amin(-1), logits.amax(-1))  # a NaN anywhere in a row makes both NaN
    # the common case in plain Python (a few calls, where numpy's checks are ~10); False
    # for a NaN, an infinity or a value near the limit, which the checks below then sort out
    if all(-LOGIT_LIMIT <= a and b <= LOGIT_LIMIT for a, b in zip(low.tolist(), high.tolist())):
        return logits, ()
    low, high = low.cpu().numpy(), high.cpu().numpy()  # (R,)
    bad = ~(np.isfinite(low) & np.isfinite(high))
    if not (bad.any() or (low < -LOGIT_LIMIT).any() or (high > LOGIT_LIMIT).any()):
        return logits, ()
    held = logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    held[torch.from_numpy(bad).to(held.device)] = 0.0
    return held, tuple(np.flatnonzero(bad).tolist())


def unpack_rows(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """(R, vocab_size) bool from R bitmasks, each unpacked once while it stays among the
    last few distinct masks (:func:`policy.allowed_tokens`)."""
    if len(masks) == 1:  # a view of the kept array: callers only read it
        return torch.from_numpy(allowed_tokens(masks[0], vocab_size)).unsqueeze(0)
    return torch.from_numpy(np.stack([allowed_tokens(m, vocab_size) for m in masks]))


def reads_history(c) -> bool:
    """Whether a row's choice reads the tokens before it (a repetition, presence or
    frequency penalty): its logits, its choice and its position alone do not decide it."""
    return c.repetition_penalty != 1 or bool(c.presence_penalty) or bool(c.frequency_penalty)


def shape_logits(logits, choices, prompt_ids, output_ids) -> tuple[torch.Tensor, list[bool]]:
    """Steps 1-2: bias, penalties, mask. Returns the logits (``logits`` itself when no
    row uses them) and which rows they changed."""
    biased = [i for i, c in enumerate(choices) if c.logit_bias]
    penalised = [i for i, c in enumerate(choices) if reads_history(c)]
    masked = [i for i, c in enumerate(choices) if c.allowed_token_bitmask]
    touched = [bool(c.logit_bias or c.allowed_token_bitmask) or reads_history(c) for c in choices]
    if not any(touched):
        return logits, touched
    out = logits.clone()
    if biased:
        _add_bias(out, choices, biased)
    if penalised:
        out[penalised] = _penalise(out[penalised], [choices[i] for i in penalised],
                                   [prompt_ids[i] if prompt_ids else () for i in penalised],
                                   [output_ids[i] if output_ids else () for i in penalised])
    if masked:
        allowed = unpack_rows([choices[i].allowed_token_bitmask for i in masked], logits.shape[1])
        out[masked] = out[masked].masked_fill(~allowed, -math.inf)
    return out, touched


def _add_bias(out: torch.Tensor, choices, rows: list[int]) -> None:
    vocab = out.shape[1]
    flat = [i * vocab + t for i in rows for t in choices[i].logit_bias]
    values = [b for i in rows for b in choices[i].logit_bias.values()]
    out.view(-1).index_add_(0, torch.tensor(flat, dtype=torch.int64), torch.tensor(values, dtype=out.dtype))


def _counts(histories: list[Sequence[int]], vocab: int) -> torch.Tensor:
    """(R, V) float32: how often each token occurs in each row's history."""
    counts = torch.zeros(len(histories), vocab)
    flat = [r * vocab + t for r, h in enumerate(histories) for t in h]
    if flat:
        counts.view(-1).index_add_(0, torch.tensor(flat, dtype=torch.int64), torch.ones(len(flat)))
    return counts


def _penalise(x: torch.Tensor, choices, prompts, outputs) -> torch.Tensor:
    """x (R, V): the repetition penalty over prompt + output, then presence and
    frequency over the output (vLLM's apply_penalties; OpenAI's formula)."""
    out_counts = _counts(outputs, x.shape[1])  # (R, V)
    return penalise_counts(x, choices, out_counts, (out_counts > 0) | (_counts(prompts, x.shape[1]) > 0))


def penalise_counts(x: torch.Tensor, choices, out_counts: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
    """:func:`_penalise` from (R, V) output counts and the (R, V) bool prompt-or-output set
    (a tensor-parallel rank passes its vocabulary slice of both)."""
    rep = torch.tensor([c.repetition_penalty for c in choices]).unsqueeze(-1)  # (R, 1)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x).clamp_(-LOGIT_LIMIT, LOGIT_LIMIT)
    frequency = torch.tensor([c.frequency_penalty for c in choices]).unsqueeze(-1)
    presence = torch.tensor([c.presence_penalty for c in choices]).unsqueeze(-1)
    return x - frequency * out_counts - presence * (out_counts > 0)
