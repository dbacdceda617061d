"""The speculative-sampling math: which drafts a verified forward keeps, and the
token after them (pure functions of the logits rows; no KV, no state)."""

from __future__ import annotations


import torch

from ferrum_rpc.rules import check_sampling
from ferrum_rpc.types import SpeculativeSampling

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): logits / T would
# overflow float32 (1e-40 makes every finite logit inf and the softmax NaN).
GREEDY_BELOW_TEMPERATURE = 1e-5


def checked_sampling(sampling: SpeculativeSampling | None) -> SpeculativeSampling | None:
    """Validates a sampling request (no state read); None where sampling is greedy."""
    if sampling is None:
        return None
    check_sampling(sampling)
    if sampling.temperature < GREEDY_BELOW_TEMPERATURE:  # logits / T would overflow float32: greedy
        return None
    return sampling


def accept_drafts(rows: torch.Tensor, draft: list[int], sampling: SpeculativeSampling | None) -> tuple[int, int]:
    """rows (1 + len(draft), V) float32: row i predicts what follows input i.  Returns
    (drafts kept, the next token): greedy keeps the longest prefix of drafts equal to
    the argmax, sampling runs :func:`accept_sampled`."""
    if sampling is not None:
        return accept_sampled(rows, draft, sampling)
    predicted = rows.argmax(dim=-1).tolist()
    agreed = 0
    while agreed < len(draft) and draft[agreed] == predicted[agreed]:
        agreed += 1
    return agreed, predicted[agreed]


def target_probs(rows: torch.Tensor, sampling: SpeculativeSampling) -> torch.Tensor:
    """rows (P, V) float32 logits -> the target's sampling distribution per row."""
    logits = rows / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = logits.topk(sampling.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(dim=-1)
    if 0 < sampling.top_p < 1:
        ordered, order = probs.sort(dim=-1, descending=True)
        drop = ordered.cumsum(dim=-1) - ordered >= sampling.top_p  # keep the smallest set reaching top_p
        probs = probs.scatter(-1, order, ordered.masked_fill(drop, 0.0))
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def accept_sampled(rows: torch.Tensor, draft: list[int], sampling: SpeculativeSampling) -> tuple[int, int]:
    """Speculative sampling for drafts proposed with certainty: draft i is kept with
    probability p_i(draft i); at the first rejection the next token is drawn from p_i
    without the rejected token, else from the row after the last draft.  Returns
    (drafts kept, next token)."""
    generator = torch.Generator().manual_seed(sampling.seed)
    probs = target_probs(rows.float().cpu(), sampling)
    for i, token in enumerate(draft):
        if torch.rand((), generator=generator).item() < probs[i, token].item():
            continue
        residual = probs[i].clone()
        residual[token] = 0.0
        return i, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(draft), int(torch.multinomial(probs[len(draft)], 1, generator=generator))
