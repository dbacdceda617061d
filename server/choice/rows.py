"""The rows of one token-choice step: what the paths fill per row (:class:`Step`) and
what the step returns (:class:`ChosenTokens`), and the row operations the paths share
(picking rows without a copy, the log-normaliser, each row's maximum).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from ferrum_rpc.types import ChosenToken, TokenLogprob

__all__ = ["ChosenTokens", "Step", "greedy_stats", "log_normaliser", "row_index", "row_max", "take_rows"]


@dataclass(frozen=True)
class ChosenTokens:
    """A batch's choices. token_ids (B,) int64; logprobs (B,) float32; top_token_ids
    and top_logprobs (B, n) with n the batch's largest top_logprobs, descending, row i
    meaningful in its first ``top_counts[i]`` entries (-inf: a token the PROCESSED
    distribution excludes, left out by :meth:`row`).  ``failed`` lists the rows whose
    logits were not finite: nothing was chosen for them (their entries are filler) and
    only their calls fail (:class:`~ferrum_rpc.errors.NonFiniteLogits`)."""

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    top_token_ids: torch.Tensor
    top_logprobs: torch.Tensor
    top_counts: tuple[int, ...]
    failed: tuple[int, ...] = ()

    def row(self, i: int) -> ChosenToken:
        n, top = self.top_counts[i], ()
        if n:
            pairs = zip(self.top_token_ids[i, :n].tolist(), self.top_logprobs[i, :n].tolist())
            top = tuple(TokenLogprob(t, lp) for t, lp in pairs if lp != -math.inf)
        return ChosenToken(self._ids[i], self._logprobs[i], top)

    @cached_property
    def _ids(self) -> list[int]:  # one conversion for every row, not an indexing op per row
        return self.token_ids.tolist()

    @cached_property
    def _logprobs(self) -> list[float]:
        return self.logprobs.tolist()

    def rows(self) -> list[ChosenToken]:
        return [self.row(i) for i in range(len(self.top_counts))]


class Step:
    """Per-row results as the paths fill them: the token, and in the distribution it
    was chosen from (PROCESSED) the log-normaliser, the token's logprob and the top-n."""

    def __init__(self, batch: int, n: int, want_top: bool):
        self.token_ids = torch.zeros(batch, dtype=torch.int64)
        self.log_norm = torch.zeros(batch)  # log of the processed logits' normaliser
        self.chosen = torch.zeros(batch)  # processed logprob of the token
        self.n = n if want_top else 0  # processed top-n wanted (some PROCESSED row asks)
        self.top_ids = torch.zeros(batch, n, dtype=torch.int64)
        self.top = torch.full((batch, n), -math.inf)
        self.raw_is_processed = [False] * batch  # the processed logits are the model's own
        self.raw_max = torch.full((batch,), math.nan)  # each row's largest logit, where a path found it
        self.raw_norm = torch.full((batch,), math.nan)  # each row's RAW log-normaliser, where known

    def put(self, index, tokens, chosen, log_norm, top=None, top_ids=None) -> None:
        """index: the rows; tokens (R,) vocabulary ids; chosen and log_norm (R,);
        top/top_ids (R, m): processed logprobs, descending, and their ids."""
        self.token_ids[index] = tokens
        self.chosen[index] = chosen.float()
        self.log_norm[index] = log_norm.float()
        if top is not None and self.n:
            width = min(self.n, top.shape[1])
            self.top[index, :width] = top[:, :width].float()
            self.top_ids[index, :width] = top_ids[:, :width]


def row_index(rows: list[int], batch: int):
    """An index for rows: a slice when it is every row (no copies), else a tensor."""
    return slice(None) if len(rows) == batch else torch.tensor(rows)


def take_rows(t: torch.Tensor, index) -> torch.Tensor:
    """t's rows at ``index`` (from :func:`row_index`): t itself for a slice."""
    return t if isinstance(index, slice) else t[index]


_GREEDY_ROWS = None


def greedy_stats(x: torch.Tensor):
    """x (R, V) float32 on the CPU -> (first index of each row's largest, largest,
    smallest, log-normaliser), each (R,), from the fused op (csrc/greedy.cpp: one pass,
    each row's sums in one fixed order); None where that op is not loaded or x is
    another kind of tensor (the torch ops serve then)."""
    global _GREEDY_ROWS
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] == 0
            or x.requires_grad):
        return None
    if _GREEDY_ROWS is None:
        try:
            _GREEDY_ROWS = torch.ops.ferrum_fused.greedy_rows
        except (AttributeError, RuntimeError):  # the kernels are not built or loaded in this process
            return None
    return _GREEDY_ROWS(x)


def greedy_op_loaded() -> bool:
    """Whether :func:`greedy_stats` has its fused op in this process."""
    return _GREEDY_ROWS is not None or greedy_stats(torch.zeros(1, 1)) is not None


def log_normaliser(x: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """(R,) logsumexp of x (R, W), one buffer, cheaper than torch.logsumexp; ``top``
    (R, 1), when given, is x's row maximum."""
    top = x.amax(-1, keepdim=True) if top is None else top
    return (top + torch.sub(x, top).exp_().sum(-1, keepdim=True).log()).squeeze(-1)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, V) -> (values (R, 1), ids (R, 1) int64): each row's largest value and the
    first index holding it, as ``x.max(-1, keepdim=True)`` gives them (a NaN counts as
    the largest, its first index too).  float32 and float64 on the CPU go through
    numpy's argmax, which is faster there than ATen's max with indices (the figures
    are in docs/token-choice.md)."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad
            or x.dim() != 2 or x.shape[1] == 0):
        return x.max(-1, keepdim=True)
    a = x.numpy()
    ids = a.argmax(axis=-1)[:, None]
    return torch.from_numpy(np.take_along_axis(a, ids, -1)), torch.from_numpy(ids.astype(np.int64, copy=False))
