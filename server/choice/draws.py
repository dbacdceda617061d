"""The seeded draw every token-choice path ends in: one uniform per row keyed by
(seed, position) (:func:`uniform_for`, the key from :func:`ferrum_rpc.hashing.draw_key`,
which callers reproduce) and the inverse CDF in vocabulary order (:func:`draw`).

The whole-row path, the candidate path and a tensor-parallel rank's slice all draw
through these, so the same (seed, position) picks the same token whichever path a row
takes.
"""

from __future__ import annotations

import secrets
from typing import Sequence

import torch

from ferrum_rpc.hashing import draw_key
from ferrum_rpc.types import TokenChoice

__all__ = ["BLOCK", "draw", "uniform_for", "uniforms"]

BLOCK = 256  # the draw's first level: float32 sums of 256-wide blocks, then one block's cumulative sum


def uniform_for(seed: int, position: int) -> float:
    """The one uniform in [0, 1) that draws the token at ``position`` of a sequence
    seeded with ``seed``: the first 8 bytes of BLAKE2b(tag || seed || position) (both
    unsigned 64-bit little-endian), top 53 bits, times 2^-53.

    A counter-based generator: the key is (seed, position) alone, so the draw does not
    depend on the batch, its order or the process. BLAKE2b because it is in every
    language's standard library (a Rust or Go caller can reproduce a draw), has no
    structure between neighbouring keys, and one hash a row is cheap next to a forward.
    """
    return (draw_key(seed, position) >> 11) * 2.0 ** -53


def uniforms(choices: Sequence[TokenChoice], rows: list[int], positions: Sequence[int]) -> torch.Tensor:
    """(R,) float64: the uniform of each of ``rows`` (indexes into ``choices`` and
    ``positions``); a row without a seed gets fresh randomness."""
    values = [uniform_for(choices[i].seed if choices[i].seed is not None else secrets.randbits(64),
                          positions[i]) for i in rows]
    return torch.tensor(values, dtype=torch.float64)


def draw(weights: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse CDF: per row the index whose cumulative-weight interval holds u * total.

    Args:
        weights: (R, W) float32 >= 0, unnormalised, each row with a positive entry.
        u: (R,) float64 uniforms in [0, 1).

    Returns:
        (R,) int64 indices and (R,) float64 row totals.

    Rows wider than 2048 take two levels, one pass over the row: float32 sums of
    256-wide blocks, a float64 cumulative sum over the blocks chooses a block, and the
    uniform's remainder, rescaled to that block, chooses inside it (a float64
    cumulative sum of 256 weights). Index i is drawn with probability w_i / total up to
    the float32 rounding of its block's sum (relative error ~1e-7, the same order as
    the float32 probabilities themselves; no absolute floor, so a rare token is as
    exact as a likely one); zero weights are never drawn.
    """
    rows, width = weights.shape
    if width <= 8 * BLOCK:
        cum = weights.cumsum(-1, dtype=torch.float64)  # (R, W)
        index = torch.searchsorted(cum, (u * cum[:, -1]).unsqueeze(-1), right=True)
        return torch.minimum(index, _last_positive(weights)).squeeze(-1), cum[:, -1]
    pad = -width % BLOCK
    blocks = (torch.nn.functional.pad(weights, (0, pad)) if pad else weights).view(rows, -1, BLOCK)  # (R, NB, BLOCK)
    sums = blocks.sum(-1).double()  # (R, NB)
    cum = sums.cumsum(-1)
    target = (u * cum[:, -1]).unsqueeze(-1)  # (R, 1)
    block = torch.searchsorted(cum, target, right=True)  # the first block whose cumulative mass passes target
    block = torch.minimum(block, _last_positive(sums))  # target rounded up to the total
    before = torch.where(block > 0, cum.gather(1, (block - 1).clamp(min=0)), 0.0)
    within = ((target - before) / sums.gather(1, block)).clamp(0.0, 1.0)  # the uniform's remainder, (R, 1)
    chosen = blocks[torch.arange(rows), block.squeeze(-1)]  # (R, BLOCK)
    inner = chosen.cumsum(-1, dtype=torch.float64)
    index = torch.searchsorted(inner, within * inner[:, -1:], right=True)
    index = torch.minimum(index, _last_positive(chosen))
    return (block * BLOCK + index).squeeze(-1), cum[:, -1]


def _last_positive(values: torch.Tensor) -> torch.Tensor:
    """(R, 1): index of each row's last positive entry."""
    index = torch.arange(values.shape[-1], device=values.device)
    return torch.where(values > 0, index, -1).amax(-1, keepdim=True)
