"""The candidate path of token choice: sampled rows with a top_k up to 4096, or top_p
alone whose 256 most likely tokens hold more than top_p of the mass, filter and draw
among those candidates only (one top-k, no sort of the vocabulary).

:func:`routes` splits a batch into greedy rows, candidate rows and whole rows;
:func:`sample_candidate_rows` runs the path on whole rows; a tensor-parallel server
merges each rank's top candidates and runs :func:`sample_candidates` on them. The draw
is in vocabulary order (:func:`draws.draw`), as on whole rows: the same uniform picks
the same token whichever path a row takes.
"""

from __future__ import annotations

import math

import torch

from .draws import draw, uniforms
from .rows import Step, log_normaliser, row_index, take_rows

__all__ = ["NUCLEUS", "candidate_width", "routes", "sample_candidate_rows", "sample_candidates"]

_CANDIDATES = 4096  # rows with top_k up to this choose among their top-k logits only
NUCLEUS = 256  # rows with top_p only try their 256 most likely tokens first


def routes(choices, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """Greedy rows; sampled rows that choose among candidates (a small top_k, or top_p
    alone); the rest (whole rows)."""
    greedy, narrow, wide = [], [], []
    for i, c in enumerate(choices):
        if c.is_greedy:
            greedy.append(i)
        elif 0 < c.top_k <= min(_CANDIDATES, vocab - 1) or (c.top_p < 1 and not 0 < c.top_k < vocab):
            narrow.append(i)
        else:
            wide.append(i)
    return greedy, narrow, wide


def sample_candidate_rows(shaped, rows: list[int], choices, positions, step: Step) -> list[int]:
    """Steps 4-6 over each row's most likely tokens only (no sort of the vocabulary):
    its top_k, or for top_p alone the 256 most likely when they hold more than top_p of
    the mass (so every other token is outside the nucleus). Returns the rows this
    cannot serve, for the full path: a k-th logit tied with logits past it (top-k keeps
    every tie), or a nucleus wider than 256 tokens."""
    x = take_rows(shaped, row_index(rows, shaped.shape[0]))  # (R, V)
    policies = [choices[i] for i in rows]
    values, ids = x.topk(candidate_width(policies, x.shape[1]), -1)
    inverse = 1 / torch.tensor([c.temperature for c in policies]).unsqueeze(-1)
    return sample_candidates(values, ids, lambda nucleus: log_normaliser(x[nucleus] * inverse[nucleus]),
                             rows, choices, positions, step, x.shape[1])


def candidate_width(policies, vocab: int) -> int:
    """How many candidates rows of ``policies`` need: one past the largest top_k (to see
    ties), NUCLEUS for a top_p row."""
    ks = [c.top_k if 0 < c.top_k < vocab else 0 for c in policies]
    return min(vocab, max(max(ks) + 1, NUCLEUS if 0 in ks else 0))


def sample_candidates(values, ids, normaliser, rows: list[int], choices, positions, step: Step,
                      vocab: int) -> list[int]:
    """The candidate path on rows' candidates: values (R, K) descending (K from
    :func:`candidate_width`) and their vocabulary ids; ``normaliser(nucleus)`` gives the
    logsumexp of the tempered whole rows picked by the (R,) bool ``nucleus`` (a tensor
    parallel server computes it across ranks). Returns the rows it cannot serve."""
    policies = [choices[i] for i in rows]
    width = values.shape[1]
    k = torch.tensor([c.top_k if 0 < c.top_k < vocab else 0 for c in policies]).unsqueeze(-1)  # (R, 1); 0: none
    tied = values.gather(1, k.clamp(max=width - 1)) == values.gather(1, (k - 1).clamp(min=0))  # k-th == (k+1)-th
    inverse = 1 / torch.tensor([c.temperature for c in policies]).unsqueeze(-1)
    z = values * inverse  # (R, K) descending
    outside = torch.zeros(len(rows), 1)  # mass beyond the candidates, in the tempered distribution
    serve = ~tied | (k == 0)
    nucleus = (k == 0).squeeze(-1)
    if bool(nucleus.any()):
        full = normaliser(nucleus)
        outside[nucleus] = (1 - torch.exp(torch.logsumexp(z[nucleus], -1) - full)).clamp(min=0).unsqueeze(-1)
        top_p = torch.tensor([c.top_p for c in policies]).unsqueeze(-1)
        serve &= ~(nucleus.unsqueeze(-1) & (outside >= 1 - top_p - 1e-5))
    keep = serve.squeeze(-1).nonzero().squeeze(-1)
    if len(keep):
        kept = [rows[r] for r in keep.tolist()]
        z = z[keep].masked_fill(torch.arange(z.shape[1]) >= torch.where(k[keep] > 0, k[keep], z.shape[1]), -math.inf)
        z = _top_p_min_p_sorted(z, [policies[r] for r in keep.tolist()], outside[keep])
        _draw_candidates(z, ids[keep], kept, choices, positions, step)
    return [rows[r] for r in (~serve.squeeze(-1)).nonzero().squeeze(-1).tolist()]


def _draw_candidates(z, ids, rows: list[int], choices, positions, step: Step) -> None:
    """The draw over candidates z (R, K), descending, of vocabulary ids ``ids``; in
    vocabulary order, as the full path draws: the same uniform, the same token."""
    by_id = ids.argsort(-1)
    weights = torch.exp(z - z[:, :1]).gather(1, by_id)
    drawn, total = draw(weights, uniforms(choices, rows, positions))
    slot = by_id.gather(1, drawn.unsqueeze(-1))  # (R, 1) into z
    log_total = total.log().float()
    chosen = z.gather(1, slot).squeeze(-1) - z[:, 0] - log_total
    top = z[:, :step.n] - z[:, :1] - log_total.unsqueeze(-1)
    step.put(torch.tensor(rows), ids.gather(1, slot).squeeze(-1), chosen, z[:, 0] + log_total, top, ids[:, :step.n])


def _top_p_min_p_sorted(z: torch.Tensor, policies, outside: torch.Tensor) -> torch.Tensor:
    """top-p and min-p as transformers computes them, on candidate rows sorted
    descending; ``outside`` (R, 1) is the mass of the tokens not among them."""
    top_p = torch.tensor([c.top_p for c in policies]).unsqueeze(-1)
    if bool((top_p < 1).any()):
        ascending = z.flip(-1)
        drop = (ascending.softmax(-1) * (1 - outside)).cumsum(-1) + outside <= 1 - top_p
        drop[:, -1] = False
        z = z.masked_fill((drop & (top_p < 1)).flip(-1), -math.inf)
    min_p = torch.tensor([c.min_p for c in policies]).unsqueeze(-1)
    if bool((min_p > 0).any()):
        probs = z.softmax(-1)
        drop = probs < min_p * probs[:, :1]
        drop[:, 0] = False
        z = z.masked_fill(drop, -math.inf)
    return z
