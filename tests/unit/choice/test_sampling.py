"""Token choice (server/choice/: sampling, candidates, shaping, draws, rows) against
transformers as the oracle: the distribution each row is drawn from (temperature,
top-k, top-p, min-p warpers; repetition penalty and sequence bias processors),
OpenAI's presence/frequency formula computed here, draws whose frequencies pass a
chi-square test, draws that depend on (seed, position) only. Tiny vocabularies plus a
few rows of SmolLM2's 49,152. The policy's checks and bitmask layout are in
test_policy.py."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ferrum_rpc.server.choice.draws import uniform_for
from ferrum_rpc.server.choice.sampling import accept_drafts, choose_tokens
from ferrum_rpc.rules import pack_allowed_tokens, unpack_allowed_tokens, validate_token_choice
from ferrum_rpc.types import LogprobsMode, TokenChoice

SMALL = 20  # == MAX_TOP_LOGPROBS: top_logprobs=20 PROCESSED lists a row's whole distribution
BIG = 49_152
PROCESSED = LogprobsMode.PROCESSED


def _small_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, SMALL, generator=torch.Generator().manual_seed(seed)) * 2.5


def _peaked_rows(n: int, seed: int = 0) -> torch.Tensor:
    """(n, BIG) logits shaped like a language model's: a bulk and ~15 standouts."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, BIG, generator=g) * 2
    for row in rows:
        row[torch.randint(0, BIG, (15,), generator=g)] += torch.rand(15, generator=g) * 6 + 8
    return rows


def _reference(row: torch.Tensor, c: TokenChoice, prompt=(), output=()) -> torch.Tensor:
    """(V,) the distribution transformers' processors (and OpenAI's formula) give."""
    scores = row.clone().unsqueeze(0)
    ids = torch.tensor([list(prompt) + list(output) or [0]])
    if c.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in c.logit_bias.items()])(ids, scores)
    if c.repetition_penalty != 1 and (prompt or output):
        scores = RepetitionPenaltyLogitsProcessor(float(c.repetition_penalty))(ids, scores)
    for token, count in Counter(output).items():  # OpenAI: mu[j] -= c[j] * frequency + (c[j] > 0) * presence
        scores[0, token] -= count * c.frequency_penalty + c.presence_penalty
    if c.allowed_token_bitmask:
        scores[0, ~torch.from_numpy(unpack_allowed_tokens(c.allowed_token_bitmask, row.shape[0]))] = -math.inf
    if not c.is_greedy:
        warpers = [TemperatureLogitsWarper(c.temperature)]
        warpers += [TopKLogitsWarper(c.top_k)] if c.top_k else []
        warpers += [TopPLogitsWarper(c.top_p)] if c.top_p < 1 else []
        warpers += [MinPLogitsWarper(c.min_p)] if c.min_p else []
        for warper in warpers:
            scores = warper(ids, scores)
    return scores.softmax(-1)[0]


def _processed(logits, choices, prompts=None, outputs=None) -> list[dict[int, float]]:
    """Each row's processed distribution as {token: probability} (PROCESSED top-20)."""
    out = choose_tokens(logits, choices, [7] * len(choices), prompts, outputs)
    return [{t.token_id: math.exp(t.logprob) for t in row.top_logprobs} for row in out.rows()]


def _assert_close(ours: dict[int, float], reference: torch.Tensor, tol=1e-5) -> None:
    dense = torch.zeros_like(reference)
    for token, p in ours.items():
        dense[token] = p
    assert torch.allclose(dense, reference, atol=tol, rtol=0), (dense - reference).abs().max()


WARPED = [
    TokenChoice(temperature=0.7),
    TokenChoice(temperature=1.3, top_k=5),
    TokenChoice(temperature=1.0, top_p=0.8),
    TokenChoice(temperature=0.9, min_p=0.15),
    TokenChoice(temperature=0.6, top_k=8, top_p=0.9, min_p=0.05),
    TokenChoice(temperature=2.0, top_p=0.3),
    TokenChoice(temperature=1.0, top_k=1),
    TokenChoice(temperature=0.0),  # greedy: the processed distribution is the row's softmax
]


@pytest.mark.parametrize("choice", WARPED, ids=repr)
def test_warped_distribution_matches_transformers_small_vocab(choice):
    rows = _small_rows(6, seed=1)
    choices = [TokenChoice(**{**choice.__dict__, "top_logprobs": SMALL, "logprobs_mode": PROCESSED})] * len(rows)
    for row, ours in zip(rows, _processed(rows, choices)):
        _assert_close(ours, _reference(row, choices[0]))


@pytest.mark.parametrize("choice", [
    TokenChoice(temperature=0.8, top_k=12),  # the candidate path
    TokenChoice(temperature=1.0, top_p=0.6),  # the full path, a sort of the vocabulary
    TokenChoice(temperature=0.7, min_p=0.1),
    TokenChoice(temperature=1.1, top_k=30, top_p=0.7, min_p=0.02),
], ids=repr)
def test_warped_distribution_matches_transformers_full_vocab(choice):
    """On SmolLM2-sized rows the filtered distribution has at most 20 tokens: all listed."""
    rows = _peaked_rows(2, seed=2)
    choice = TokenChoice(**{**choice.__dict__, "top_logprobs": 20, "logprobs_mode": PROCESSED})
    for row, ours in zip(rows, _processed(rows, [choice] * 2)):
        reference = _reference(row, choice)
        assert int((reference > 0).sum()) <= 20
        _assert_close(ours, reference)


@pytest.mark.parametrize("choice", [
    TokenChoice(temperature=1.0, top_p=0.5),  # a nucleus of thousands: the sort of the vocabulary
    TokenChoice(temperature=0.9, top_k=5000, min_p=0.3),  # top_k past the candidate path's 4096
], ids=repr)
def test_wide_filters_match_transformers_on_their_top_20(choice):
    rows = torch.randn(2, BIG, generator=torch.Generator().manual_seed(16)) * 0.5
    choice = TokenChoice(**{**choice.__dict__, "top_logprobs": 20, "logprobs_mode": PROCESSED})
    out = choose_tokens(rows, [choice] * 2, [1, 2])
    for row, got in zip(rows, out.rows()):
        reference = _reference(row, choice)
        assert int((reference > 0).sum()) > 256
        top = reference.topk(20)
        assert [t.token_id for t in got.top_logprobs] == top.indices.tolist()
        assert [math.exp(t.logprob) for t in got.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-6)
        assert math.exp(got.logprob) == pytest.approx(float(reference[got.token_id]), abs=1e-6)


def test_top_k_keeps_ties_at_the_kth_logit_as_transformers():
    row = torch.tensor([[5.0, 3.0, 3.0, 3.0, 1.0, 0.0] + [-1.0] * 14])
    choice = TokenChoice(top_k=2, top_logprobs=SMALL, logprobs_mode=PROCESSED)
    (ours,) = _processed(row, [choice])
    assert sorted(ours) == [0, 1, 2, 3]
    _assert_close(ours, _reference(row[0], choice))


def test_repetition_penalty_matches_transformers_over_prompt_and_output():
    rows = _small_rows(4, seed=3)
    prompts, outputs = [[1, 2, 3], [4], [5, 5, 6], []], [[7, 1], [], [8], [9, 9]]
    for penalty in (1.3, 0.7):
        choice = TokenChoice.greedy(repetition_penalty=penalty, top_logprobs=SMALL, logprobs_mode=PROCESSED)
        ours = _processed(rows, [choice] * 4, prompts, outputs)
        for row, p, o, got in zip(rows, prompts, outputs, ours):
            _assert_close(got, _reference(row, choice, p, o))


def test_repetition_penalty_differs_from_transformers_on_padding():
    """transformers penalises every id in input_ids: in a left-padded batch that
    includes the pad id, which is no token of the sequence; ours sees only the
    sequence's own prompt and output."""
    row, pad = _small_rows(1, seed=4), 0
    prompt = [3, 4]
    choice = TokenChoice.greedy(repetition_penalty=2.0, top_logprobs=SMALL, logprobs_mode=PROCESSED)
    (ours,) = _processed(row, [choice], [prompt], [[]])
    padded = RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[pad, pad] + prompt]), row.clone()).softmax(-1)[0]
    _assert_close(ours, _reference(row[0], choice, prompt))
    assert ours[pad] > 5 * float(padded[pad])  # transformers made the pad id ~10x less likely


def test_logit_bias_matches_sequence_bias_processor():
    rows = _small_rows(3, seed=5)
    choice = TokenChoice(temperature=0.9, logit_bias={2: 3.5, 7: -100.0, 11: 0.25}, top_logprobs=SMALL,
                         logprobs_mode=PROCESSED)
    for row, ours in zip(rows, _processed(rows, [choice] * 3, [[1]] * 3)):
        _assert_close(ours, _reference(row, choice, [1]))
        assert 7 not in ours or ours[7] < 1e-30


def test_presence_and_frequency_penalties_follow_openai():
    rows = _small_rows(3, seed=6)
    outputs = [[1, 1, 1, 2], [3], []]
    choice = TokenChoice.greedy(presence_penalty=0.5, frequency_penalty=-0.75, top_logprobs=SMALL,
                                logprobs_mode=PROCESSED)
    ours = _processed(rows, [choice] * 3, [[4, 4, 5]] * 3, outputs)  # prompt tokens: no presence/frequency
    for row, output, got in zip(rows, outputs, ours):
        expected = row.clone().double()
        for token, count in Counter(output).items():
            expected[token] -= count * -0.75 + 0.5
        _assert_close(got, expected.softmax(-1).float())


def test_every_stage_together_in_vllm_order():
    rows = _small_rows(4, seed=7)
    mask = pack_allowed_tokens([0, 2, 3, 5, 8, 9, 13, 17, 19], SMALL)
    choice = TokenChoice(temperature=0.8, top_k=6, top_p=0.95, min_p=0.01, repetition_penalty=1.2,
                         presence_penalty=0.3, frequency_penalty=0.2, logit_bias={5: 1.5, 9: -0.5},
                         allowed_token_bitmask=mask, top_logprobs=SMALL, logprobs_mode=PROCESSED)
    prompt, output = [2, 3, 3], [5, 5, 9]
    for row, ours in zip(rows, _processed(rows, [choice] * 4, [prompt] * 4, [output] * 4)):
        _assert_close(ours, _reference(row, choice, prompt, output))


def test_raw_logprobs_are_the_models_log_softmax_whatever_the_policy():
    rows = torch.cat([_small_rows(3, seed=8), _small_rows(3, seed=9)])
    choices = [TokenChoice(top_logprobs=5), TokenChoice(temperature=0.5, top_k=3, top_logprobs=20),
               TokenChoice.greedy(repetition_penalty=1.5, top_logprobs=1),
               TokenChoice(allowed_token_bitmask=pack_allowed_tokens([4], SMALL), top_logprobs=3),
               TokenChoice(temperature=1.7, min_p=0.2), TokenChoice(top_p=0.5, top_logprobs=2)]
    out = choose_tokens(rows, choices, range(6), [[1, 2]] * 6, [[3]] * 6)
    expected = torch.log_softmax(rows.double(), -1)
    for i, (row, choice) in enumerate(zip(out.rows(), choices)):
        assert row.logprob == pytest.approx(float(expected[i, row.token_id]), abs=1e-5)
        top = expected[i].topk(choice.top_logprobs)
        assert [t.token_id for t in row.top_logprobs] == top.indices.tolist()
        assert [t.logprob for t in row.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-5)
    assert out.row(3).token_id == 4


def test_raw_logprobs_full_vocab_plain_sampling():
    rows = _peaked_rows(3, seed=10)
    choices = [TokenChoice(temperature=1.0, seed=1, top_logprobs=4), TokenChoice(temperature=0.6, seed=2),
               TokenChoice.greedy(top_logprobs=2)]
    out = choose_tokens(rows, choices, [3, 4, 5])
    expected = torch.log_softmax(rows.double(), -1)
    for i, row in enumerate(out.rows()):
        assert row.logprob == pytest.approx(float(expected[i, row.token_id]), abs=1e-4)
        assert [t.token_id for t in row.top_logprobs] == expected[i].topk(choices[i].top_logprobs).indices.tolist()
    assert out.row(2).token_id == int(rows[2].argmax())


@given(seed=st.integers(0, 2**64 - 1), position=st.integers(0, 2**31),
       temperature=st.sampled_from([0.0, 0.5, 1.0, 3.0]), top_k=st.sampled_from([0, 1, 3, 30]),
       top_p=st.sampled_from([1.0, 0.9, 0.2]), min_p=st.sampled_from([0.0, 0.3]),
       allowed=st.sets(st.integers(0, 69), min_size=1, max_size=70), mode=st.sampled_from(list(LogprobsMode)))
@settings(max_examples=60, deadline=None, derandomize=True)
def test_any_policy_chooses_an_allowed_token_of_positive_probability(seed, position, temperature, top_k, top_p,
                                                                      min_p, allowed, mode):
    row = torch.randn(1, 70, generator=torch.Generator().manual_seed(seed % 1000)) * 3
    choice = TokenChoice(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                         allowed_token_bitmask=pack_allowed_tokens(allowed, 70), top_logprobs=5, logprobs_mode=mode)
    validate_token_choice(choice, 70)
    got = choose_tokens(row, [choice], [position]).row(0)
    assert got.token_id in allowed and math.isfinite(got.logprob) and got.logprob <= 1e-6
    if mode is PROCESSED:
        assert all(t.token_id in allowed for t in got.top_logprobs)


def _chi_square_bound(df: int, z: float = 4.7534) -> float:
    """The chi-square quantile for a false-failure probability of 1e-6 (z is the
    standard normal's 1 - 1e-6 quantile), by Wilson and Hilferty's approximation."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("choice, logits", [
    (TokenChoice(temperature=0.9), "small"),
    (TokenChoice(temperature=1.2, top_k=6, top_p=0.9), "small"),
    (TokenChoice(temperature=1.0, top_k=10), "big"),
    (TokenChoice(temperature=1.0, top_p=0.9), "big"),
], ids=lambda v: repr(v) if isinstance(v, TokenChoice) else v)
def test_draw_frequencies_pass_chi_square(choice, logits):
    """N draws with seeds 0..N-1 (one batched call): Pearson's statistic over the
    categories expected at least 5 times (the rest pooled) stays under the 1 - 1e-6
    quantile, so a correct sampler fails this test once in a million runs."""
    n = 20_000 if logits == "small" else 2_000
    row = _small_rows(1, seed=11)[0] if logits == "small" else _peaked_rows(1, seed=12)[0]
    probs = _reference(row, choice).double()
    policies = [TokenChoice(**{**choice.__dict__, "seed": s}) for s in range(n)]
    chunk = 4_000 if logits == "small" else 200  # draws do not depend on the batch: chunks keep memory small
    drawn = torch.cat([choose_tokens(row.expand(len(policies[i:i + chunk]), -1), policies[i:i + chunk],
                                     [41] * len(policies[i:i + chunk])).token_ids for i in range(0, n, chunk)])
    assert bool((probs[drawn] > 0).all()), "drew a token the distribution excludes"
    counts = torch.bincount(drawn, minlength=row.shape[0]).double()
    expected = probs * n
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    wanted = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    assert statistic < _chi_square_bound(int(keep.sum()) - 1)


def test_same_seed_and_position_same_token_alone_and_in_a_shuffled_mixed_batch():
    small, big = _small_rows(8, seed=13), _peaked_rows(2, seed=14)
    rows = [torch.nn.functional.pad(r, (0, BIG - SMALL), value=-30.0) for r in small] + list(big)
    mask = pack_allowed_tokens(range(0, BIG, 3), BIG)
    kinds = [TokenChoice(temperature=0.8), TokenChoice(top_k=5), TokenChoice(top_p=0.7, temperature=1.3),
             TokenChoice.greedy(), TokenChoice(min_p=0.05), TokenChoice(repetition_penalty=1.4, presence_penalty=1.0),
             TokenChoice(allowed_token_bitmask=mask), TokenChoice(logit_bias={3: 2.0}, top_logprobs=3),
             TokenChoice(temperature=0.5, top_k=200, logprobs_mode=PROCESSED, top_logprobs=2)]
    cases = [(rows[i % len(rows)], TokenChoice(**{**kinds[i % len(kinds)].__dict__, "seed": 1000 + i}), 5 + i,
              [1, 2, 3], [i % 7, 4]) for i in range(16)]
    alone = [choose_tokens(r.unsqueeze(0), [c], [p], [pr], [o]).row(0) for r, c, p, pr, o in cases]
    order = list(range(16))
    random.Random(0).shuffle(order)
    batch = choose_tokens(torch.stack([cases[i][0] for i in order]), [cases[i][1] for i in order],
                          [cases[i][2] for i in order], [cases[i][3] for i in order], [cases[i][4] for i in order])
    for slot, i in enumerate(order):
        got = batch.row(slot)
        assert got.token_id == alone[i].token_id
        assert got.logprob == pytest.approx(alone[i].logprob, abs=1e-5)


def test_draw_is_keyed_by_seed_and_position():
    row = _small_rows(1, seed=15).expand(64, -1)
    by_seed = choose_tokens(row, [TokenChoice(seed=s) for s in range(64)], [9] * 64).token_ids
    by_position = choose_tokens(row, [TokenChoice(seed=3)] * 64, range(64)).token_ids
    assert len(set(by_seed.tolist())) > 3 and len(set(by_position.tolist())) > 3
    again = choose_tokens(row, [TokenChoice(seed=s) for s in range(64)], [9] * 64).token_ids
    assert torch.equal(by_seed, again)
    assert uniform_for(3, 9) == uniform_for(3, 9) != uniform_for(3, 10)
    assert uniform_for(2**64 - 1, 2**40) < 1.0


def test_candidate_and_full_paths_draw_the_same_token():
    """A row with top_k takes the top-k candidates only, a row without draws over the
    vocabulary; both walk the tokens in vocabulary order, so when top-k removes
    nothing with mass the same uniform picks the same token."""
    row = torch.full((1, BIG), -1e4)
    row[0, torch.tensor([5, 900, 31_000, 40_000, 49_000])] = torch.tensor([1.0, 2.0, 0.5, 1.5, 0.1])
    for seed in range(50):
        narrow = choose_tokens(row, [TokenChoice(seed=seed, top_k=5)], [3]).token_ids
        wide = choose_tokens(row, [TokenChoice(seed=seed)], [3]).token_ids
        assert torch.equal(narrow, wide)


@pytest.mark.parametrize("choice", [TokenChoice(seed=5, temperature=0.7, top_k=4, repetition_penalty=1.3,
                                                presence_penalty=0.5, top_logprobs=2),
                                    TokenChoice.greedy(frequency_penalty=1.0)], ids=["sampled", "greedy"])
def test_accept_drafts_equals_one_at_a_time_decoding(choice):
    """Drafts built from the sequential choices, with a wrong one at index 3: the
    first three are kept and the next token is the sequential choice there."""
    rows = _small_rows(6, seed=17)
    prompt, output, start = [1, 2], [3], 10
    sequential = []
    for i in range(6):
        sequential.append(choose_tokens(rows[i:i + 1], [choice], [start + i], [prompt],
                                        [output + [c.token_id for c in sequential]]).row(0))
    drafts = [c.token_id for c in sequential[:5]]
    kept, chosen = accept_drafts(rows, drafts, choice, start, prompt, output)
    assert kept == 5 and [c.token_id for c in chosen] == [c.token_id for c in sequential]
    assert [c.logprob for c in chosen] == pytest.approx([c.logprob for c in sequential], abs=1e-6)
    wrong = drafts[:3] + [(drafts[3] + 1) % SMALL] + drafts[4:]
    kept, chosen = accept_drafts(rows, wrong, choice, start, prompt, output)
    assert kept == 3 and [c.token_id for c in chosen] == [c.token_id for c in sequential[:4]]


def test_row_max_is_torch_max_with_its_ties_and_nans():
    """row_max (numpy's argmax on the CPU) gives what x.max(-1, keepdim=True) gives:
    the first index of a tied maximum, a NaN as the largest (its first index)."""
    from ferrum_rpc.server.choice.rows import row_max

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 1000, generator=gen)
    x[1, 7] = x[1, 900] = 50.0  # a tie: the first wins
    x[2, 3] = x[2, 40] = float("nan")
    x[3] = -float("inf")
    for rows in (x, x[::2], x.double(), x[:, :500]):  # strided views and float64 too
        got, want = row_max(rows), rows.max(-1, keepdim=True)
        assert torch.equal(got[1], want.indices) and got[1].dtype == torch.int64
        assert torch.allclose(got[0], want.values, equal_nan=True) and got[0].dtype == rows.dtype
    bf = x.bfloat16()  # other dtypes: torch's own max
    assert torch.equal(row_max(bf)[1], bf.max(-1, keepdim=True).indices)


# -- every valid policy over every row: a defined answer or a defined error --------------------------------

@given(penalty=st.sampled_from([5e-324, 1e-45, 1e-38, 1e-20, 1e20, 1e38, 1.7e308]),
       temperature=st.sampled_from([0.0, 1e-5, 0.7, 1.0, 50.0]), top_k=st.sampled_from([0, 5, 69]),
       top_p=st.sampled_from([1.0, 0.5]), min_p=st.sampled_from([0.0, 0.2]), width=st.sampled_from([70, 3000]),
       seed=st.integers(0, 2**64 - 1), scale=st.sampled_from([1.0, 1e35]))
@settings(max_examples=120, deadline=None, derandomize=True)
def test_any_finite_penalty_over_any_finite_row_chooses_a_token(penalty, temperature, top_k, top_p, min_p, width,
                                                              seed, scale):
    row = torch.randn(1, width, generator=torch.Generator().manual_seed(seed % 1000)) * 4 * scale
    choice = TokenChoice(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, seed=seed,
                         repetition_penalty=penalty, top_logprobs=3)
    validate_token_choice(choice, width)
    history = list(range(0, width, 3))  # a third of the vocabulary is penalised, both signs
    got = choose_tokens(row, [choice], [7], [history], [history[:5]])
    assert got.failed == ()
    token = got.row(0)
    assert 0 <= token.token_id < width and not math.isnan(token.logprob)


def test_non_finite_rows_fail_alone_and_the_others_are_chosen_as_without_them():
    rows = torch.randn(4, 3000, generator=torch.Generator().manual_seed(3)) * 3
    choices = [TokenChoice(temperature=1.0, seed=11), TokenChoice.greedy(), TokenChoice(temperature=0.8, top_k=20,
                                                                                        seed=12),
               TokenChoice(temperature=1.0, top_p=0.9, seed=13)]
    alone = [choose_tokens(rows[i:i + 1], [choices[i]], [i]).row(0) for i in range(4)]
    poisoned = rows.clone()
    poisoned[1, 17] = math.nan
    poisoned[2, 5] = math.inf
    out = choose_tokens(poisoned, choices, range(4))
    assert out.failed == (1, 2)
    assert [out.row(0), out.row(3)] == [alone[0], alone[3]]
    poisoned[0, 0] = -math.inf  # a model's -inf is as unservable as +inf or NaN
    assert choose_tokens(poisoned, choices, range(4)).failed == (0, 1, 2)


def test_rows_past_the_logit_limit_are_held_to_it_and_only_non_finite_rows_fail():
    """held_finite's quick check passes a row only where the full check would; a row
    with a value at the float32 nearest the limit, past it, or not finite takes the
    full check (held, or failed)."""
    from ferrum_rpc.server.choice.shaping import LOGIT_LIMIT, held_finite

    near = float(torch.tensor(LOGIT_LIMIT, dtype=torch.float32))  # the float32 nearest, just past 1e30
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    same, failed = held_finite(rows)
    assert same is rows and failed == ()
    rows[1, 3], rows[2, 7], rows[3, 9], rows[4, 0] = near, -1e35, math.nan, -math.inf
    held, failed = held_finite(rows)
    assert failed == (3, 4)
    assert held[1, 3] == near and held[2, 7] == -LOGIT_LIMIT  # held in float32, as clamp gives it
    assert torch.equal(held[0], rows[0]) and torch.all(held[3:] == 0)
