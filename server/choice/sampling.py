"""The executor chooses the token: one batched, wire-independent step from logits rows
to chosen tokens. Pure torch; the executor validates with
:func:`policy.validate_token_choice` before any state changes and the executor calls
:func:`choose_tokens` on the rows the LM head produced.

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
   (seed, position) (:func:`uniform_for`, :func:`draw`).

Paths: steps 1-2 are skipped (no copy of the logits) when no row uses them. Rows
with a top_k up to 4096, or top_p alone whose 256 most likely tokens hold more
than top_p of the mass, filter and draw among those candidates only (one top-k,
no sort of the vocabulary); other filtered rows sort their rows as transformers
does. Plain sampling is exp((x - max) / T) in one fused pass, an in-place exp,
and float32 block sums. Every path draws in vocabulary order, so the same uniform
picks the same token whichever path a row takes.

A tensor-parallel server runs the same steps over each rank's vocabulary slice
and reduces across ranks (``tp_choice``), reusing the candidate path and the draw.

Logprobs: RAW by default (the model's log-softmax, vLLM's default; see
``LogprobsMode``); its normaliser costs one more exp pass over rows whose
processed logits differ from the model's (temperature != 1, penalties, ...).
PROCESSED logprobs come from the distribution the draw used, at no extra pass.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np
import torch

from ferrum_rpc.errors import NonFiniteLogits
from ferrum_rpc.hashing import draw_key
from ferrum_rpc.types import (
    ChosenToken,
    LogprobsMode,
    TokenChoice,
    TokenLogprob,
)

__all__ = ["ChosenTokens", "accept_drafts", "choose_tokens", "uniform_for"]

# Logits are held to +-LOGIT_LIMIT before temperature: a repetition penalty may be any finite
# value > 0, and l / 1e-38 overflows float32. At the smallest sampled temperature (1e-5) a
# held logit is 1e35, still finite, so every difference and exp below stays defined.
LOGIT_LIMIT = 1e30
BLOCK = 256  # the draw's first level: float32 sums of 256-wide blocks, then one block's cumulative sum


# ---------------------------------------------------------------------------- bitmask rows

def unpack_rows(masks: list[bytes], vocab_size: int) -> torch.Tensor:
    """(R, vocab_size) bool from R bitmasks, vectorised: shift each word by 0..31."""
    words = np.frombuffer(b"".join(masks), dtype="<i4").astype(np.int32).reshape(len(masks), -1)
    words = torch.from_numpy(words)  # (R, W)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # (R, W, 32)
    return bits.reshape(len(masks), -1)[:, :vocab_size].bool()


# ---------------------------------------------------------------------------- randomness

def uniform_for(seed: int, position: int) -> float:
    """The one uniform in [0, 1) that draws the token at ``position`` of a sequence
    seeded with ``seed``: the first 8 bytes of BLAKE2b(tag || seed || position) (both
    unsigned 64-bit little-endian), top 53 bits, times 2^-53.

    A counter-based generator: the key is (seed, position) alone, so the draw does not
    depend on the batch, its order or the process. BLAKE2b because it is in every
    language's standard library (a Rust or Go caller can reproduce a draw), has no
    structure between neighbouring keys, and costs ~1 us a row.
    """
    return (draw_key(seed, position) >> 11) * 2.0 ** -53


def uniforms(choices: Sequence[TokenChoice], rows: list[int], positions: Sequence[int]) -> torch.Tensor:
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


# ---------------------------------------------------------------------------- the step

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
        n = self.top_counts[i]
        pairs = zip(self.top_token_ids[i, :n].tolist(), self.top_logprobs[i, :n].tolist())
        return ChosenToken(int(self.token_ids[i]), float(self.logprobs[i]),
                           tuple(TokenLogprob(t, lp) for t, lp in pairs if lp != -math.inf))

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
    logits = logits.float()
    batch, vocab = logits.shape
    if len(choices) != batch or len(positions) != batch:
        raise ValueError(f"{batch} rows but {len(choices)} choices and {len(positions)} positions")
    logits, failed = held_finite(logits)
    shaped, touched = _shape(logits, choices, prompt_token_ids, output_token_ids)
    n = min(max(c.top_logprobs for c in choices), vocab)
    step = Step(batch, n, any(c.top_logprobs and c.logprobs_mode is LogprobsMode.PROCESSED for c in choices))
    greedy, narrow, wide = routes(choices, vocab)
    if greedy:
        _choose_greedy(shaped, greedy, touched, step)
    if narrow:
        wide = sorted(wide + _sample_candidates(shaped, narrow, choices, positions, step))
    if wide:
        _sample_full(shaped, wide, choices, positions, touched, step)
    chosen = _finish(logits, choices, step)
    return replace(chosen, failed=failed) if failed else chosen


def held_finite(logits: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """(R, V) float32 -> the rows to choose from, and the rows that hold a NaN or an
    infinity.  Those rows are zeroed (every path stays defined on them; their results
    are discarded) and rows past +-LOGIT_LIMIT are held to it: one aminmax pass, and a
    copy only when some row needs either."""
    low, high = torch.aminmax(logits, dim=-1)  # a NaN anywhere in a row makes both NaN
    bad = ~(torch.isfinite(low) & torch.isfinite(high))
    wide = (low < -LOGIT_LIMIT) | (high > LOGIT_LIMIT)
    if not bool((bad | wide).any()):
        return logits, ()
    held = logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    held[bad] = 0.0
    return held, tuple(bad.nonzero().squeeze(-1).tolist())


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


def _index(rows: list[int], batch: int):
    """An index for rows: a slice when it is every row (no copies), else a tensor."""
    return slice(None) if len(rows) == batch else torch.tensor(rows)


def _rows(t: torch.Tensor, index) -> torch.Tensor:
    return t if isinstance(index, slice) else t[index]


def _log_normaliser(x: torch.Tensor, top: torch.Tensor | None = None) -> torch.Tensor:
    """(R,) logsumexp of x (R, W), one buffer, cheaper than torch.logsumexp; ``top``
    (R, 1), when given, is x's row maximum."""
    top = x.amax(-1, keepdim=True) if top is None else top
    return (top + torch.sub(x, top).exp_().sum(-1, keepdim=True).log()).squeeze(-1)


def row_max(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, V) -> (values (R, 1), ids (R, 1) int64): each row's largest value and the
    first index holding it, as ``x.max(-1, keepdim=True)`` gives them (a NaN counts as
    the largest, its first index too).  float32 and float64 on the CPU go through
    numpy's argmax: ATen's max with indices took 45 us over one 49,152-wide row here
    and 135 over four, numpy 10 and 25."""
    if (x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or x.requires_grad
            or x.dim() != 2 or x.shape[1] == 0):
        return x.max(-1, keepdim=True)
    a = x.numpy()
    ids = a.argmax(axis=-1)[:, None]
    return torch.from_numpy(np.take_along_axis(a, ids, -1)), torch.from_numpy(ids.astype(np.int64, copy=False))


def _choose_greedy(shaped, rows: list[int], touched: list[bool], step: Step) -> None:
    """Step 3: the argmax of the penalised, biased, masked logits."""
    index = _index(rows, shaped.shape[0])
    x = _rows(shaped, index)
    largest, tokens = row_max(x)
    tokens = tokens.squeeze(-1)
    log_norm = _log_normaliser(x, largest)
    chosen = x.gather(1, tokens.unsqueeze(-1)).squeeze(-1) - log_norm
    top, top_ids = x.topk(step.n, -1) if step.n else (None, None)
    step.put(index, tokens, chosen, log_norm, None if top is None else top - log_norm.unsqueeze(-1), top_ids)
    for i in rows:
        step.raw_is_processed[i] = not touched[i]


def _sample_full(shaped, rows: list[int], choices, positions, touched, step: Step) -> None:
    """Steps 4-6 over whole rows: temperature, the transformers-style filters (a sort
    of the vocabulary, for the rare rows the candidate path cannot serve), the draw."""
    index = _index(rows, shaped.shape[0])
    x = _rows(shaped, index)
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


def _sample_candidates(shaped, rows: list[int], choices, positions, step: Step) -> list[int]:
    """Steps 4-6 over each row's most likely tokens only (no sort of the vocabulary):
    its top_k, or for top_p alone the 256 most likely when they hold more than top_p of
    the mass (so every other token is outside the nucleus). Returns the rows this
    cannot serve, for the full path: a k-th logit tied with logits past it (top-k keeps
    every tie), or a nucleus wider than 256 tokens."""
    x = _rows(shaped, _index(rows, shaped.shape[0]))  # (R, V)
    policies = [choices[i] for i in rows]
    values, ids = x.topk(candidate_width(policies, x.shape[1]), -1)
    inverse = 1 / torch.tensor([c.temperature for c in policies]).unsqueeze(-1)
    return sample_candidates(values, ids, lambda nucleus: _log_normaliser(x[nucleus] * inverse[nucleus]),
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


def _shape(logits, choices, prompt_ids, output_ids) -> tuple[torch.Tensor, list[bool]]:
    """Steps 1-2: bias, penalties, mask. Returns the logits (``logits`` itself when no
    row uses them) and which rows they changed."""
    biased = [i for i, c in enumerate(choices) if c.logit_bias]
    penalised = [i for i, c in enumerate(choices)
                 if c.repetition_penalty != 1 or c.presence_penalty or c.frequency_penalty]
    masked = [i for i, c in enumerate(choices) if c.allowed_token_bitmask]
    touched = [bool(c.logit_bias or c.allowed_token_bitmask or c.repetition_penalty != 1
                    or c.presence_penalty or c.frequency_penalty) for c in choices]
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
        index = _index(raw, len(choices))
        x = _rows(logits, index)
        fresh = [r for r, i in enumerate(raw) if not step.raw_is_processed[i]]
        log_norm = step.log_norm[index].clone()
        if fresh:
            known = step.raw_max[index][fresh]
            largest = None if bool(known.isnan().any()) else known.unsqueeze(-1)
            log_norm[fresh] = _log_normaliser(x if len(fresh) == len(raw) else x[fresh], largest)
        chosen = chosen.clone()
        chosen[index] = x.gather(1, step.token_ids[index].unsqueeze(-1)).squeeze(-1) - log_norm
        listed = [r for r, i in enumerate(raw) if choices[i].top_logprobs]
        if listed and top.shape[1]:
            values, ids = (x if len(listed) == len(raw) else x[listed]).topk(top.shape[1], -1)
            at = torch.tensor([raw[r] for r in listed])
            top, top_ids = top.clone(), top_ids.clone()
            top[at], top_ids[at] = values - log_norm[listed].unsqueeze(-1), ids
    return ChosenTokens(step.token_ids, chosen, top_ids, top, tuple(c.top_logprobs for c in choices))
