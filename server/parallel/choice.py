"""Token choice on a vocabulary-parallel LM head without gathering whole rows.

Each rank holds a contiguous slice [lo, hi) of every logits row.  The steps of
``sampling.choose_tokens`` split into elementwise ones, run on each rank's slice
(bias, penalties, the allowed-token mask, temperature, min-p), and reductions,
which cross the ranks as a few numbers a row:

- greedy: (max, argmax) per rank;
- logprobs: a global logsumexp from each rank's (max, sum of exp(x - max));
- top-k (k <= 4096) and top-p (its 256 most likely first): each rank's local top-W
  candidates, merged; the candidate path of ``choose_tokens`` then runs unchanged;
- plain temperature sampling and min-p: the inverse CDF with per-rank masses.  Ranks
  own contiguous vocabulary ranges, so the draw in vocabulary order splits exactly:
  the row's uniform picks a rank by the ranks' cumulative masses, that rank draws
  inside its slice with the uniform's remainder.  The same (seed, position) hence
  gives the same token at any degree as at degree 1, up to float rounding at an
  interval's edge.  vLLM v1's exponential race (argmax of p / Exp(1) noise) would
  reduce as (max, argmax) too, but needs a random number per token and would draw
  other tokens than our degree-1 draw, which callers can reproduce (``uniform_for``).
- the rest (top-k > 4096, a nucleus wider than 256 tokens, top-k ties past the
  candidates, top-p with a top-k above 4096, candidates costlier than the row, see
  below): whole rows of those rows only, counted in ``Shard.choice_fallback_rows``
  and logged once.

vLLM and TGI gather whole rows before choosing (vLLM's ``LogitsProcessor`` through
``tensor_model_parallel_gather``, TGI's ``TensorParallelHead`` through all_gather); this does
not.  Bytes each rank sends a row a forward (W and n are the batch's largest): 48
(6 float64 statistics) + 8 per candidate (float32 value, int32 id; W of them) + 8 per
raw top logprob (n), then 8 (a mass, when some row samples the whole vocabulary),
then 24 (token, processed and raw logit): greedy without logprobs 72 bytes, top-k 50
with 5 logprobs 520 bytes, against 4*V/N for a whole row (96 KiB for SmolLM2 at
degree 2).  A row whose candidates would fill half its slice or more (a wide top-k
on a small vocabulary) costs less whole, so it goes whole.
Rank 0 broadcasts with the plan, per choosing row: the policy (its bitmask is V/8
bytes, 6 KiB for SmolLM2, whole: one broadcast reaches every rank, so slices would
add up to the whole), the uniform's seed, and the penalised rows' distinct token
ids and output counts (not the histories).

Every rank runs this same code on the same gathered numbers (SPMD), so all agree on
each row's route and on which rows fall back, with no extra round trip.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch

from ferrum_rpc.types import LogprobsMode, TokenChoice

from ..choice.candidates import candidate_width, routes, sample_candidates
from ..choice.draws import BLOCK, draw, uniforms
from ..choice.rows import ChosenTokens, Step
from ..choice.sampling import choose_tokens
from ..choice.shaping import penalise_counts, reads_history, unpack_rows

Gather = Callable[[torch.Tensor], list[torch.Tensor]]  # all_gather: this rank's (R, C) -> every rank's
_STATS = 6  # raw max, raw sum, shaped max, its argmax, tempered max, tempered sum


@dataclass(frozen=True)
class RowRequest:
    """What every rank needs to choose one row's token (broadcast with the plan)."""

    row: int  # among this forward's LM-head rows
    choice: TokenChoice  # seed always set: rank 0 draws one for an unseeded row, so all ranks draw alike
    position: int
    seen: np.ndarray  # distinct ids of prompt + output (repetition penalty); empty when not penalised
    out_ids: np.ndarray  # distinct ids of the output (presence, frequency)
    out_counts: np.ndarray  # how often each occurs

    @classmethod
    def of(cls, row: int, choice: TokenChoice, position: int, prompt: Sequence[int],
           output: Sequence[int]) -> RowRequest:
        if choice.seed is None:
            choice = replace(choice, seed=secrets.randbits(64))
        out_ids, out_counts = np.unique(np.asarray(output, dtype=np.int64), return_counts=True)
        seen = np.union1d(np.asarray(prompt, dtype=np.int64), out_ids)
        return cls(row, choice, position, seen, out_ids, out_counts.astype(np.int64))

    def histories(self) -> tuple[list[int], list[int]]:
        """(prompt, output) as ``choose_tokens`` reads them (order does not matter to the penalties)."""
        return self.seen.tolist(), np.repeat(self.out_ids, self.out_counts).tolist()


def plain(choice: TokenChoice, vocab: int) -> bool:
    """Sampled over the whole vocabulary with at most min-p: the per-rank-mass draw serves it."""
    return not choice.is_greedy and not 0 < choice.top_k < vocab and choice.top_p == 1


# ---------------------------------------------------------------------------- elementwise

def shape_slice(raw: torch.Tensor, requests: Sequence[RowRequest], lo: int, vocab: int) -> torch.Tensor:
    """Steps 1-2 of ``choose_tokens`` (bias, penalties, mask) on the slice [lo, lo + W)
    of each row; ``raw`` itself when no row uses them."""
    choices = [r.choice for r in requests]
    if not any(c.logit_bias or c.allowed_token_bitmask or reads_history(c) for c in choices):
        return raw
    out, width = raw.clone(), raw.shape[1]
    flat, values = [], []
    for i, c in enumerate(choices):
        for token, bias in c.logit_bias.items():
            if lo <= token < lo + width:
                flat.append(i * width + token - lo)
                values.append(bias)
    if flat:
        out.view(-1).index_add_(0, torch.tensor(flat, dtype=torch.int64), torch.tensor(values, dtype=out.dtype))
    penalised = [i for i, c in enumerate(choices) if reads_history(c)]
    if penalised:
        counts, seen = torch.zeros(len(penalised), width), torch.zeros(len(penalised), width, dtype=torch.bool)
        for j, i in enumerate(penalised):
            ids, n = torch.from_numpy(requests[i].out_ids), torch.from_numpy(requests[i].out_counts)
            mine = (ids >= lo) & (ids < lo + width)
            counts[j, ids[mine] - lo] = n[mine].float()
            s = torch.from_numpy(requests[i].seen)
            seen[j, s[(s >= lo) & (s < lo + width)] - lo] = True
        out[penalised] = penalise_counts(out[penalised], [choices[i] for i in penalised], counts, seen)
    masked = [i for i, c in enumerate(choices) if c.allowed_token_bitmask]
    if masked:
        allowed = unpack_rows([choices[i].allowed_token_bitmask for i in masked], vocab)[:, lo:lo + width]
        out[masked] = out[masked].masked_fill(~allowed, -math.inf)
    return out


def _max_and_sum(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(R,) max and sum of exp(x - max) of x (R, W); a row of -inf gives (-inf, 0)."""
    top = x.amax(-1, keepdim=True)
    safe = torch.where(top.isfinite(), top, torch.zeros_like(top))
    return top.squeeze(-1), torch.sub(x, safe).exp_().sum(-1)


def _combine(maxes: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Global logsumexp (R,) from every rank's (N, R) max and sum."""
    top = maxes.amax(0)
    return top + (sums * (maxes - top).exp()).sum(0).log()


def _top(values: torch.Tensor, width: int, lo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, width) largest values, descending, as int32 bit patterns, and their global ids
    (int32); padded with -inf and id -1 where the slice is narrower."""
    got = min(width, values.shape[1])
    v, i = values.topk(got, -1)
    pad = width - got
    if pad:
        v = torch.nn.functional.pad(v, (0, pad), value=-math.inf)
        i = torch.nn.functional.pad(i, (0, pad), value=-1 - lo)
    return v.contiguous().view(torch.int32), (i + lo).int()


def _merge(parts: torch.Tensor, at: int, sent: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``sent`` candidates, columns [at, at + 2*sent) of (N, R, C) int32, ->
    the global top-``width`` values (float32) and ids (int64)."""
    rows = parts.shape[1]
    if not width:
        return torch.zeros(rows, 0), torch.zeros(rows, 0, dtype=torch.int64)
    values = parts[:, :, at:at + sent].contiguous().view(torch.float32).permute(1, 0, 2).reshape(rows, -1)
    ids = parts[:, :, at + sent:at + 2 * sent].permute(1, 0, 2).reshape(rows, -1)  # (R, N*sent)
    best, where = values.topk(width, -1)
    return best, ids.gather(1, where).long()


def _mass(weights: torch.Tensor, vocab: int) -> torch.Tensor:
    """(R,) float64 mass of each row's slice, summed as ``draws.draw`` sums the whole row
    (float32 sums of 256-wide blocks above 2048 tokens, so block edges match when a rank
    starts at a multiple of 256)."""
    if vocab <= 8 * BLOCK:
        return weights.double().sum(-1)
    pad = -weights.shape[1] % BLOCK
    blocks = torch.nn.functional.pad(weights, (0, pad)) if pad else weights
    return blocks.view(weights.shape[0], -1, BLOCK).sum(-1).double().sum(-1)


# ---------------------------------------------------------------------------- the step

def choose_sharded(local: torch.Tensor, requests: Sequence[RowRequest], rank: int, lo: int, vocab: int,
                   slice_width: int, gather: Gather,
                   gather_rows: Callable[[torch.Tensor], torch.Tensor]) -> tuple[ChosenTokens, int]:
    """Chooses one token per request from this rank's slice of the LM head's rows.

    Args:
        local: (N, W) float32, this rank's vocabulary slice [lo, lo + W) of the forward's rows.
        requests: the rows that choose (their ``row`` indexes ``local``); the same on every rank.
        rank: this rank.
        lo: where its slice starts.
        vocab: the whole vocabulary.
        slice_width: the widest rank's slice (ceil(vocab / N)).
        gather: all_gather of a (R, C) tensor, same shape on every rank.
        gather_rows: (R, W) slices -> (R, vocab) whole rows (the fallback).

    Returns:
        The choices (meaningful on every rank) and how many rows fell back to whole rows.
    """
    raw = local[torch.tensor([r.row for r in requests])].float()  # (R, W)
    choices = [r.choice for r in requests]
    positions = [r.position for r in requests]
    x = shape_slice(raw, requests, lo, vocab)
    rows = len(requests)
    n = min(max(c.top_logprobs for c in choices), vocab)
    greedy, narrow, wide = routes(choices, vocab)
    spread = [i for i in wide if plain(choices[i], vocab)]
    whole = [i for i in wide if i not in spread]
    # a candidate costs 8 bytes (value, id), a row 4 a token: a row needing half a slice goes whole
    costly = [i for i in narrow if 2 * candidate_width([choices[i]], vocab) >= slice_width]
    whole += costly
    narrow = [i for i in narrow if i not in costly]
    narrow_width = candidate_width([choices[i] for i in narrow], vocab) if narrow else 0
    width = max(narrow_width, n)
    sent, sent_n = min(width, slice_width), min(n, slice_width)  # no rank has more than its slice
    inverse = 1 / torch.tensor([1.0 if c.is_greedy else c.temperature for c in choices]).unsqueeze(-1)  # (R, 1)
    z = x * inverse  # (R, W): the tempered logits (greedy rows: x)

    # one gather: statistics, shaped candidates, raw top-n
    raw_max, raw_sum = _max_and_sum(raw)
    x_max, x_arg = x.max(-1)
    z_max, z_sum = _max_and_sum(z)
    stats = torch.stack([raw_max, raw_sum, x_max, x_arg + lo, z_max, z_sum], -1).double()  # (R, 6)
    payload = torch.cat([stats.view(torch.int32), *_top(x, sent, lo), *_top(raw, sent_n, lo)], -1)  # (R, C) int32
    parts = torch.stack(gather(payload))  # (N, R, C)
    at = 2 * _STATS
    numbers = parts[..., :at].contiguous().view(torch.float64)  # (N, R, 6)
    raw_lse = _combine(numbers[..., 0], numbers[..., 1])  # (R,)
    best = numbers[..., 2].amax(0)
    argmax = torch.where(numbers[..., 2] == best, numbers[..., 3], math.inf).amin(0).long()  # lowest id of ties
    z_lse, z_top = _combine(numbers[..., 4], numbers[..., 5]).float(), numbers[..., 4].amax(0).float()
    cand, cand_ids = _merge(parts, at, sent, width)
    raw_top, raw_top_ids = _merge(parts, at + 2 * sent, sent_n, n)

    step = Step(rows, n, any(c.top_logprobs and c.logprobs_mode is LogprobsMode.PROCESSED for c in choices))
    if greedy:
        at = torch.tensor(greedy)
        log_norm = z_lse[at]
        step.put(at, argmax[at], best[at].float() - log_norm, log_norm, cand[at, :n] - log_norm.unsqueeze(-1),
                 cand_ids[at, :n])
    if narrow:
        at = torch.tensor(narrow)
        whole += sample_candidates(cand[at, :narrow_width], cand_ids[at, :narrow_width],
                                   lambda nucleus: z_lse[at][nucleus], narrow, choices, positions, step, vocab)
    known = step.token_ids.clone()  # each row's token where this rank knows it, else -1
    known[torch.tensor(whole, dtype=torch.int64)] = -1
    if spread:
        mine, drawn, total = _draw_spread(z, z_top, spread, choices, positions, rank, lo, vocab, gather)
        at = torch.tensor(spread)
        known[at] = -1
        known[at[mine]] = drawn

    # one gather: each token's processed and raw logit, from the rank that owns it
    owned = torch.full((rows, 3), -1.0, dtype=torch.float64)
    inside = ((known >= lo) & (known < lo + x.shape[1])).nonzero().squeeze(-1)
    if len(inside):
        local_ids = (known[inside] - lo).unsqueeze(-1)
        owned[inside] = torch.stack([known[inside].double(), z[inside].gather(1, local_ids).squeeze(-1).double(),
                                     raw[inside].gather(1, local_ids).squeeze(-1).double()], -1)
    got = torch.stack(gather(owned))  # (N, R, 3)
    owner = got[..., 0].argmax(0)  # the one rank with a token >= 0
    picked = got[owner, torch.arange(rows)]  # (R, 3)
    tokens, z_tok, raw_tok = picked[:, 0].long(), picked[:, 1].float(), picked[:, 2].float()

    if spread:
        _finish_spread(step, spread, tokens, z_tok, z_top, total, cand, cand_ids, inverse, choices, n)
    return _finish(step, choices, tokens, raw_tok, raw_lse.float(), raw_top, raw_top_ids, whole, requests, raw,
                   positions, gather_rows), len(whole)


def _draw_spread(z, z_top, spread, choices, positions, rank, lo, vocab, gather):
    """The inverse CDF over ranks: the row's uniform picks a rank by cumulative mass,
    that rank draws in its slice with the remainder (one gather of a mass a row).
    Returns (which spread rows this rank drew, their global token ids, each row's
    total mass)."""
    at = torch.tensor(spread)
    weights = (z[at] - z_top[at].unsqueeze(-1)).exp_()  # (S, W): exp(z - global max)
    min_p = torch.tensor([choices[i].min_p for i in spread]).unsqueeze(-1)
    weights = weights.masked_fill(weights < min_p, 0.0)  # p < min_p * p_max, as p / p_max = weight
    masses = torch.cat(gather(_mass(weights, vocab).unsqueeze(-1)), -1)  # (S, N)
    cum = masses.cumsum(-1)
    total = cum[:, -1:]
    target = uniforms(choices, spread, positions).unsqueeze(-1) * total  # (S, 1)
    last = torch.where(masses > 0, torch.arange(masses.shape[1]), -1).amax(-1, keepdim=True)
    owner = torch.minimum(torch.searchsorted(cum, target, right=True), last)
    before = torch.where(owner > 0, cum.gather(1, (owner - 1).clamp(min=0)), 0.0)
    within = ((target - before) / masses.gather(1, owner)).clamp(0.0, 1.0).squeeze(-1)
    mine = (owner == rank).squeeze(-1)
    tokens = torch.zeros(0, dtype=torch.int64)
    if bool(mine.any()):
        tokens = draw(weights[mine], within[mine])[0] + lo
    return mine, tokens, total.squeeze(-1)


def _finish_spread(step, spread, tokens, z_tok, z_top, total, cand, cand_ids, inverse, choices, n):
    """The spread rows' processed logprobs: log(weight / total), top-n from the candidates."""
    at = torch.tensor(spread)
    log_total = total.log().float()
    top = z_top[at]
    chosen = z_tok[at] - top - log_total
    top_w = top_ids = None
    if n:
        zc = cand[at, :n] * inverse[at]
        top_w = (zc - top.unsqueeze(-1)).exp()
        min_p = torch.tensor([choices[i].min_p for i in spread]).unsqueeze(-1)
        top_w = top_w.masked_fill(top_w < min_p, 0.0).log() - log_total.unsqueeze(-1)
        top_ids = cand_ids[at, :n]
    step.put(at, tokens[at], chosen, top + log_total, top_w, top_ids)


def _finish(step, choices, tokens, raw_tok, raw_lse, raw_top, raw_top_ids, whole, requests, raw, positions,
            gather_rows) -> ChosenTokens:
    """RAW logprobs against the global raw normaliser; the fallback rows from whole rows."""
    chosen, top, top_ids = step.chosen.clone(), step.top.clone(), step.top_ids.clone()
    for i, c in enumerate(choices):
        if c.logprobs_mode is LogprobsMode.RAW:
            chosen[i] = raw_tok[i] - raw_lse[i]
            top[i], top_ids[i] = raw_top[i] - raw_lse[i], raw_top_ids[i]
    if whole:
        full = gather_rows(raw[torch.tensor(whole)])  # (F, V)
        histories = [requests[i].histories() for i in whole]
        fell = choose_tokens(full, [choices[i] for i in whole], [positions[i] for i in whole],
                             [h[0] for h in histories], [h[1] for h in histories])
        at = torch.tensor(whole)
        tokens = tokens.clone()
        tokens[at], chosen[at] = fell.token_ids, fell.logprobs
        m = fell.top_logprobs.shape[1]
        top[at] = -math.inf
        top[at, :m], top_ids[at, :m] = fell.top_logprobs, fell.top_token_ids
    return ChosenTokens(tokens, chosen, top_ids, top, tuple(c.top_logprobs for c in choices))
