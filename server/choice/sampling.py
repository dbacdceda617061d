"""The executor chooses the token: one batched, wire-independent step from logits rows
to chosen tokens. Pure torch; the executor validates with
:func:`policy.validate_token_choice` before any state changes and the executor calls
:func:`choose_tokens` on the rows the LM head produced.

This module holds the step and its whole-row paths (greedy, the transformers-style
filters, the logprobs); ``shaping`` holds steps 1-2, ``candidates`` the candidate
path, ``draws`` the seeded draw, ``rows`` the per-row results and row operations.

Order of operations per row (vLLM's sampler; transformers' processor order):

1. logit bias (added), then the repetition penalty, then presence and frequency
   penalties. Token sets:
   - repetition: every token of the sequence, prompt and output (vLLM; CTRL). A
     logit l of such a token becomes l / r where l > 0, else l * r: the formula of
     transformers' ``RepetitionPenaltyLogitsProcessor``, which applies it to every id
     in its ``input_ids``; in ``generate`` for a decoder-only model that is the same
     set, but transformers also penalises whatever else sits in ``input_ids`` (the
     pad id of a left-padded batch) and can skip the prompt (``prompt_ignore_length``);
     for encoder-decoder models it sees decoder ids only.
   - presence and frequency: output tokens only (the tokens chosen so far, not the
     prompt), OpenAI's formula ``l[j] -= c[j] * frequency + (c[j] > 0) * presence``
     with c[j] the count of j in the output. transformers has no such processor.
   Bias comes first as in vLLM v1 (a logits processor before its penalties) and in
   transformers (``SequenceBiasLogitsProcessor`` before the repetition penalty).
2. the allowed-token bitmask: disallowed tokens get -inf.
3. greedy rows (temperature < 1e-5): the argmax; nothing below applies.
4. temperature: logits / T.
5. top-k, then top-p, then min-p, each exactly as transformers' warpers compute it
   (ties at the k-th logit kept; top-p's ascending cumulative sum; min-p against
   the most likely token's probability; at least one token always kept).
6. the draw: inverse CDF in vocabulary order with one uniform per row, keyed by
   (seed, position) (:func:`draws.uniform_for`, :func:`draws.draw`).

Paths: steps 1-2 are skipped (no copy of the logits) when no row uses them. A batch
of greedy rows whose only shaping is an allowed-token bitmask (RAW logprobs, no top
list) skips them too: the argmax of the model's row stands where the mask allows it,
and the masked row's argmax is taken only for the rows where it does not
(:func:`_masked_greedy`, the same bits). A greedy row's RAW normaliser is the fused
op's over the model's row whichever path it takes. Rows
with a top_k up to 4096, or top_p alone whose 256 most likely tokens hold more
than top_p of the mass, filter and draw among those candidates only (``candidates``:
one top-k, no sort of the vocabulary); other filtered rows sort their rows as
transformers does. Plain sampling is exp((x - max) / T) in one fused pass, an in-place exp,
and float32 block sums. Every path draws in vocabulary order, so the same uniform
picks the same token whichever path a row takes.

A tensor-parallel server runs the same steps over each rank's vocabulary slice
and reduces across ranks (``parallel/choice.py``), reusing the candidate path and the draw.

Logprobs: RAW by default (the model's log-softmax, vLLM's default; see
``LogprobsMode``); its normaliser costs one more exp pass over rows whose
processed logits differ from the model's (temperature != 1, penalties, ...).
PROCESSED logprobs come from the distribution the draw used, at no extra pass.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from ferrum_rpc.errors import NonFiniteLogits
from ferrum_rpc.types import ChosenToken, LogprobsMode, TokenChoice

from .candidates import routes, sample_candidate_rows
from .draws import draw, uniforms
from ferrum_rpc.rules import allows
from .masks import allowed_tokens
from .rows import ChosenTokens, Step, greedy_stats, log_normaliser, row_index, row_max, take_rows
from .shaping import held_finite, reads_history, shape_logits

__all__ = ["accept_drafts", "choose_plain_greedy", "choose_tokens", "masked_greedy_choice", "plain_choice"]


def choose_tokens(
    logits: torch.Tensor,
    choices: Sequence[TokenChoice],
    positions: Sequence[int],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
) -> ChosenTokens:
    """Chooses one token per row.

    Args:
        logits: (B, V) rows, any float dtype (computed in float32).
        choices: B validated policies (see :func:`validate_token_choice`).
        positions: B ints, the index in its sequence of the token being chosen (the
            sequence's length before it): keys the draw with the row's seed.
        prompt_token_ids: B sequences of the tokens before the output (repetition
            penalty only); None: no prompt tokens.
        output_token_ids: B sequences of the tokens chosen so far (all three
            penalties); None: none yet.

    Returns:
        ChosenTokens: ids, logprobs and top alternatives, per row; rows holding a NaN or
        an infinity are listed in ``failed`` and choose nothing (the others are chosen
        exactly as if those rows were absent).
    """
    if logits.dtype != torch.float32:
        logits = logits.float()
    batch, vocab = logits.shape
    if len(choices) != batch or len(positions) != batch:
        raise ValueError(f"{batch} rows but {len(choices)} choices and {len(positions)} positions")
    greedy, narrow, wide = routes(choices, vocab)
    stats = greedy_stats(logits) if greedy else None  # greedy rows: one pass over every row
    held, failed = held_finite(logits, None if stats is None else (stats[2], stats[1]))
    if held is not logits:
        stats = None  # computed over the rows before they were held
    elif stats is not None and len(greedy) == batch:
        if all(plain_choice(c) for c in choices):
            return _plain_greedy(stats)
        if all(masked_greedy_choice(c) for c in choices):
            return _masked_greedy(logits, choices, stats)
    logits = held
    shaped, touched = shape_logits(logits, choices, prompt_token_ids, output_token_ids)
    n = min(max(c.top_logprobs for c in choices), vocab)
    step = Step(batch, n, any(c.top_logprobs and c.logprobs_mode is LogprobsMode.PROCESSED for c in choices))
    if shaped_greedy := [i for i in greedy if touched[i]]:
        # their RAW normaliser: the fused op's over the model's row, as _masked_greedy takes it
        raw = stats if stats is not None else greedy_stats(logits)
        if raw is not None:
            step.raw_norm[shaped_greedy] = raw[3][shaped_greedy]
    if greedy:
        _choose_greedy(shaped, greedy, touched, step, stats if shaped is logits else None)
    if narrow:
        wide = sorted(wide + sample_candidate_rows(shaped, narrow, choices, positions, step))
    if wide:
        _sample_full(shaped, wide, choices, positions, touched, step)
    chosen = _finish(logits, choices, step)
    return replace(chosen, failed=failed) if failed else chosen


def accept_drafts(
    rows: torch.Tensor,
    draft_token_ids: Sequence[int],
    choice: TokenChoice,
    first_position: int,
    prompt_token_ids: Sequence[int] = (),
    output_token_ids: Sequence[int] = (),
) -> tuple[int, list[ChosenToken]]:
    """Speculative acceptance by the policy's own choice (SpeculativeDecode with a
    token_choice): row i of ``rows`` (N+1, V) is the distribution after the first i
    drafts; draft i is kept while it equals what ``choice`` chooses at position
    first_position + i with drafts[:i] appended to the output. As each choice depends
    only on its row, (seed, position) and that history, the kept drafts and the next
    token are exactly those of one-at-a-time decoding, in one batched step.

    Returns:
        The number of drafts kept, and the choices: one per kept draft, then the next
        token (the choice after the last kept draft).
    """
    drafts = list(draft_token_ids)
    histories = [list(output_token_ids) + drafts[:i] for i in range(len(drafts) + 1)]
    picked = choose_tokens(rows, [choice] * len(histories), range(first_position, first_position + len(histories)),
                           [prompt_token_ids] * len(histories), histories)
    if picked.failed:
        raise NonFiniteLogits(f"the model's logits at position {first_position + picked.failed[0]} are not finite "
                              "(NaN or infinity); no token can be chosen there")
    chosen = picked.rows()
    kept = 0
    while kept < len(drafts) and chosen[kept].token_id == drafts[kept]:
        kept += 1
    return kept, chosen[:kept + 1]


_NO_TOP: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _no_top(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (batch, 0) top ids (int64) and logprobs (float32), made once per batch size
    (nothing can write into a tensor without elements)."""
    if (empty := _NO_TOP.get(batch)) is None:
        empty = _NO_TOP.setdefault(batch, (torch.zeros(batch, 0, dtype=torch.int64), torch.zeros(batch, 0)))
    return empty


def plain_choice(c: TokenChoice) -> bool:
    """Whether a row's choice leaves its logits as they are and lists no top logprobs."""
    return not (c.top_logprobs or c.logit_bias or c.allowed_token_bitmask or reads_history(c))


def masked_greedy_choice(c: TokenChoice) -> bool:
    """Whether a greedy row's choice is :func:`plain_choice` but for an allowed-token
    bitmask, with RAW logprobs: its logprob is the model's, against the model's
    normaliser, so only the argmax reads the mask."""
    return (c.is_greedy and not (c.top_logprobs or c.logit_bias or reads_history(c))
            and (not c.allowed_token_bitmask or c.logprobs_mode is LogprobsMode.RAW))


def choose_plain_greedy(logits: torch.Tensor) -> ChosenTokens | None:
    """:func:`choose_tokens` of float32 CPU rows whose choices are all greedy and
    :func:`plain_choice`, with the same bits; None where it would take another path
    (the fused greedy op not loaded, a row not finite or past the logit limit)."""
    stats = greedy_stats(logits)
    if stats is None or held_finite(logits, (stats[2], stats[1]))[0] is not logits:
        return None
    return _plain_greedy(stats)


def _plain_greedy(stats) -> ChosenTokens:
    """Greedy rows, unshaped, no top logprobs: the token's logprob is its logit (the row's
    largest) less the normaliser in either mode, as the general steps give it."""
    ids, largest, _, log_norm = stats
    batch = ids.shape[0]
    return ChosenTokens(ids, largest - log_norm, *_no_top(batch), (0,) * batch)


def _masked_greedy(logits: torch.Tensor, choices, stats) -> ChosenTokens:
    """Greedy rows of :func:`masked_greedy_choice`, ``stats`` :func:`greedy_stats` of their
    (finite, unheld) rows: the bits the general steps give them at about the cost of plain
    greedy.  A row's largest logit, at the first index holding it, is also the largest
    of the allowed tokens at the first allowed index holding it whenever the mask allows
    that index (the common case: one bit test).  Other rows take the argmax of the row
    with its forbidden tokens at -inf, numpy's first index of the largest as the fused
    op gives it over the masked row.  The logprob is RAW: the token's logit less the
    model's normaliser (stats), as the general steps' _finish takes it for these rows."""
    ids, _, _, log_norm = stats
    tokens = ids
    vocab = logits.shape[1]
    for i, c in enumerate(choices):
        mask = c.allowed_token_bitmask
        if mask and not allows(mask, int(ids[i])):
            row = logits[i].numpy()
            best = int(np.where(allowed_tokens(mask, vocab), row, -np.inf).argmax())
            if tokens is ids:
                tokens = ids.clone()
            tokens[i] = best
    chosen = logits.gather(1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    batch = tokens.shape[0]
    return ChosenTokens(tokens, chosen, *_no_top(batch), (0,) * batch)


def _choose_greedy(shaped, rows: list[int], touched: list[bool], step: Step, stats=None) -> None:
    """Step 3: the argmax of the penalised, biased, masked logits.  ``stats``:
    :func:`greedy_stats` of ``shaped``'s rows, where the caller has them.  Every greedy
    row takes that op where it is loaded, so a row's logprob bits do not depend on the
    rows beside it."""
    index = row_index(rows, shaped.shape[0])
    x = take_rows(shaped, index)
    if stats is None:
        stats = greedy_stats(x)
    elif not isinstance(index, slice):
        stats = tuple(t[index] for t in stats)
    if stats is not None:
        tokens, log_norm = stats[0], stats[3]
    else:
        largest, tokens = row_max(x)
        tokens = tokens.squeeze(-1)
        log_norm = log_normaliser(x, largest)
    chosen = x.gather(1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    top, top_ids = x.topk(step.n, -1) if step.n else (None, None)
    step.put(index, tokens, chosen, log_norm, None if top is None else top - log_norm.unsqueeze(-1), top_ids)
    for i in rows:
        step.raw_is_processed[i] = not touched[i]


def _sample_full(shaped, rows: list[int], choices, positions, touched, step: Step) -> None:
    """Steps 4-6 over whole rows: temperature, the transformers-style filters (a sort
    of the vocabulary, for the rare rows the candidate path cannot serve), the draw."""
    index = row_index(rows, shaped.shape[0])
    x = take_rows(shaped, index)
    policies = [choices[i] for i in rows]
    inverse = 1 / torch.tensor([c.temperature for c in policies]).unsqueeze(-1)  # (R, 1)
    filtered = [r for r, c in enumerate(policies) if 0 < c.top_k < x.shape[1] or c.top_p < 1 or c.min_p > 0]
    if filtered:
        z = x * inverse
        z[filtered] = _filter(z[filtered], [policies[r] for r in filtered])
        top = z.amax(-1, keepdim=True)
        weights = z.sub_(top).exp_()
    else:  # exp((x - max) / T): one fused pass and an in-place exp
        largest = x.amax(-1, keepdim=True)
        untouched = [r for r, i in enumerate(rows) if not touched[i]]  # their maximum is the model's
        step.raw_max[torch.tensor([rows[r] for r in untouched], dtype=torch.int64)] = largest.squeeze(-1)[untouched]
        top = largest * inverse
        weights = torch.addcmul(-top, x, inverse).exp_()
        _restore_the_largest(weights, x, inverse)
    tokens, total = draw(weights, uniforms(choices, rows, positions))
    log_total = total.log().float()
    chosen = weights.gather(1, tokens.unsqueeze(-1)).squeeze(-1).log() - log_total
    top_w, top_ids = weights.topk(step.n, -1) if step.n else (None, None)
    step.put(index, tokens, chosen, top.squeeze(-1) + log_total,
             None if top_w is None else top_w.log() - log_total.unsqueeze(-1), top_ids)
    plain = set(filtered)
    for r, i in enumerate(rows):
        step.raw_is_processed[i] = not touched[i] and r not in plain and choices[i].temperature == 1


def _restore_the_largest(weights: torch.Tensor, x: torch.Tensor, inverse: torch.Tensor) -> None:
    """The fused exp((x - max) / T) rounds x / T only after subtracting, so at |x / T|
    past ~1e9 (a held logit at a tiny temperature) the largest weight itself can
    underflow to 0.  Such a row's distribution sits on its largest logits: it gets equal
    weights on them (ties included), the limit of the exact computation."""
    lost = ~(weights.amax(-1) > 0)
    if bool(lost.any()):
        z = x[lost] * inverse[lost]
        weights[lost] = (z == z.amax(-1, keepdim=True)).to(weights.dtype)


def _filter(z: torch.Tensor, choices: list[TokenChoice]) -> torch.Tensor:
    """top-k, top-p, min-p as transformers' TopK/TopP/MinPLogitsWarper (min_tokens_to_keep=1)."""
    vocab = z.shape[1]
    ks = [c.top_k if 0 < c.top_k < vocab else 0 for c in choices]
    if any(ks):
        kth = z.topk(max(ks), -1).values  # (R, kmax) descending
        k = torch.tensor(ks).unsqueeze(-1)  # (R, 1); 0: off
        threshold = torch.where(k > 0, kth.gather(1, (k - 1).clamp(min=0)), -math.inf)
        z = z.masked_fill(z < threshold, -math.inf)
    top_p = torch.tensor([c.top_p for c in choices]).unsqueeze(-1)
    if bool((top_p < 1).any()):
        ordered, order = torch.sort(z, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - top_p  # (R, V)
        drop[:, -1] = False
        drop &= top_p < 1
        z = z.masked_fill(drop.scatter(1, order, drop), -math.inf)
    min_p = torch.tensor([c.min_p for c in choices]).unsqueeze(-1)
    if bool((min_p > 0).any()):
        probs = z.softmax(-1)
        drop = probs < min_p * probs.amax(-1, keepdim=True)
        drop.scatter_(1, probs.argmax(-1, keepdim=True), False)
        z = z.masked_fill(drop, -math.inf)
    return z


def _finish(logits: torch.Tensor, choices, step: Step) -> ChosenTokens:
    """Each row's logprobs in its mode: PROCESSED as the paths left them, RAW against
    the model's own log-softmax (its normaliser reused where the row was untouched)."""
    chosen, top, top_ids = step.chosen, step.top, step.top_ids
    raw = [i for i, c in enumerate(choices) if c.logprobs_mode is LogprobsMode.RAW]
    if raw:
        index = row_index(raw, len(choices))
        x = take_rows(logits, index)
        fresh = [r for r, i in enumerate(raw) if not step.raw_is_processed[i]]
        log_norm = step.log_norm[index].clone()
        norms = step.raw_norm[index]
        known_norm = norms.tolist()
        if fused := [r for r in fresh if not math.isnan(known_norm[r])]:  # shaped greedy rows: the op's normaliser
            log_norm[fused] = norms[fused]
            fresh = [r for r in fresh if math.isnan(known_norm[r])]
        if fresh:
            known = step.raw_max[index][fresh]
            largest = None if bool(known.isnan().any()) else known.unsqueeze(-1)
            log_norm[fresh] = log_normaliser(x if len(fresh) == len(raw) else x[fresh], largest)
        chosen = chosen.clone()
        chosen[index] = x.gather(1, step.token_ids[index].unsqueeze(-1)).squeeze(-1) - log_norm
        listed = [r for r, i in enumerate(raw) if choices[i].top_logprobs]
        if listed and top.shape[1]:
            values, ids = (x if len(listed) == len(raw) else x[listed]).topk(top.shape[1], -1)
            at = torch.tensor([raw[r] for r in listed])
            top, top_ids = top.clone(), top_ids.clone()
            top[at], top_ids[at] = values - log_norm[listed].unsqueeze(-1), ids
    return ChosenTokens(step.token_ids, chosen, top_ids, top, tuple(c.top_logprobs for c in choices))
