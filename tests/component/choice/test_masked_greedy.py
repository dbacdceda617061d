"""Greedy rows under an allowed-token bitmask: the fast path (``_masked_greedy``, a bit
test on the model's argmax) gives the bits the general steps give (the bitmask unpacked,
the row masked, its argmax), across random rows and masks: ties, a forbidden argmax,
masks allowing one token; alone and beside other rows.  The unpacked masks are kept
per distinct bytes, in a bounded table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.server.choice import masks
from ferrum_rpc.rules import allows, pack_allowed_tokens, validate_token_choice
from ferrum_rpc.server.choice.masks import allowed_tokens
from ferrum_rpc.server.choice.sampling import choose_tokens, masked_greedy_choice
from ferrum_rpc.server.kernels import fused
from ferrum_rpc.types import LogprobsMode, TokenChoice

SAMPLED = TokenChoice(temperature=0.9, seed=5)  # beside the greedy rows, it sends the batch down the general steps


@pytest.fixture(scope="module")
def ops():
    ok, why = fused.probe_fused(torch.float32)
    assert ok, f"the fused ops should build and agree on this machine: {why}"
    return torch.ops.ferrum_fused


def cases(seed: int, batch: int, vocab: int):
    """Rows (batch, vocab) and one greedy choice per row: a mask that forbids the row's
    argmax, one allowing a single token, one over a tie (some tied tokens forbidden),
    a random mask, or none; ties built in every row."""
    gen = np.random.default_rng(seed)
    x = torch.from_numpy(gen.standard_normal((batch, vocab)).astype(np.float32) * 4)
    choices = []
    for i in range(batch):
        row = x[i]
        tied = gen.choice(vocab, size=min(vocab, 4), replace=False)
        row[tied] = row.max() + float(gen.integers(0, 2))  # the tie is the largest, or level with it
        kind = i % 5
        if kind == 0:  # the argmax forbidden, everything else allowed
            allowed = np.setdiff1d(np.arange(vocab), [int(row.argmax())])
        elif kind == 1:  # one token allowed
            allowed = [int(gen.integers(0, vocab))]
        elif kind == 2:  # the tie's first members forbidden, its last allowed, plus a random half
            allowed = np.union1d(np.flatnonzero(gen.random(vocab) < 0.5), sorted(tied)[-1:])
            allowed = np.setdiff1d(allowed, sorted(tied)[:-1])
        elif kind == 3:
            allowed = np.flatnonzero(gen.random(vocab) < gen.random())
        else:
            choices.append(TokenChoice(temperature=0.0))
            continue
        allowed = allowed if len(allowed) else [vocab - 1]  # a one-token vocabulary
        choices.append(TokenChoice(temperature=0.0, allowed_token_bitmask=pack_allowed_tokens(allowed, vocab)))
    return x, choices


def reference(x: torch.Tensor, c: TokenChoice) -> tuple[int, float]:
    """The masked row's first largest, and its model logprob in float64."""
    row = x.clone()
    if c.allowed_token_bitmask:
        row[~torch.from_numpy(allowed_tokens(c.allowed_token_bitmask, x.shape[0]))] = -math.inf
    token = int(row.max(-1).indices)
    return token, torch.log_softmax(x.double(), -1)[token].item()


@pytest.mark.parametrize("vocab", [1, 33, 1000, 49152])
def test_fast_path_gives_the_general_steps_bits(ops, isa, vocab):
    for seed in range(6):
        x, choices = cases(seed + vocab, 10, vocab)
        assert all(masked_greedy_choice(c) for c in choices)
        fast = choose_tokens(x, choices, range(10))
        general = choose_tokens(torch.cat([x, x[:1]]), choices + [SAMPLED], range(11))
        assert fast.failed == general.failed == ()
        assert torch.equal(fast.token_ids, general.token_ids[:10])
        assert torch.equal(fast.logprobs, general.logprobs[:10])  # bit for bit
        assert fast.rows() == general.rows()[:10]
        for i, c in enumerate(choices):
            token, logprob = reference(x[i], c)
            assert fast.row(i).token_id == token
            assert c.allowed_token_bitmask == b"" or allows(c.allowed_token_bitmask, token)
            assert abs(fast.row(i).logprob - logprob) < 1e-4
            alone = choose_tokens(x[i:i + 1], [c], [i])  # batch invariance: the same bits alone
            assert alone.row(0) == fast.row(i) and alone.logprobs[0].item() == fast.logprobs[i].item()


def test_rows_the_fast_path_leaves_choose_as_before(ops):
    """PROCESSED logprobs, a top list or a bias under a mask take the general steps;
    their tokens are still the masked argmax and a PROCESSED logprob is against the
    masked row."""
    x, _ = cases(7, 1, 3000)
    row = x[0]
    mask = pack_allowed_tokens(np.setdiff1d(np.arange(3000), [int(row.argmax())]), 3000)
    want, _ = reference(row, TokenChoice(temperature=0.0, allowed_token_bitmask=mask))
    processed = TokenChoice(temperature=0.0, allowed_token_bitmask=mask, logprobs_mode=LogprobsMode.PROCESSED)
    listed = TokenChoice(temperature=0.0, allowed_token_bitmask=mask, top_logprobs=3)
    for c in (processed, listed, TokenChoice(temperature=0.0, allowed_token_bitmask=mask, logit_bias={1: 0.0})):
        assert not masked_greedy_choice(c)
        assert choose_tokens(x, [c], [0]).row(0).token_id == want
    masked = row.clone()
    masked[~torch.from_numpy(allowed_tokens(mask, 3000))] = -math.inf
    got = choose_tokens(x, [processed], [0]).row(0).logprob
    assert abs(got - torch.log_softmax(masked.double(), -1)[want].item()) < 1e-5


def test_a_row_past_the_logit_limit_or_not_finite_beside_masked_rows(ops):
    """The fast path needs finite, unheld rows: a batch with a held or a failed row takes
    the general steps, and the masked rows' bits are those they have alone."""
    x, choices = cases(11, 5, 2000)
    x[4, 3] = 1e35  # held to the limit
    both = torch.cat([x, x[:1]])
    both[5, 0] = math.nan
    out = choose_tokens(both, choices + [choices[0]], range(6))
    assert out.failed == (5,)
    for i in range(4):
        alone = choose_tokens(x[i:i + 1], [choices[i]], [i])
        assert out.row(i) == alone.row(0) and out.logprobs[i].item() == alone.logprobs[0].item()


def test_allowed_tokens_keeps_the_last_distinct_masks():
    vocab = 100
    first = pack_allowed_tokens([3, 64, 99], vocab)
    got = allowed_tokens(first, vocab)
    assert np.flatnonzero(got).tolist() == [3, 64, 99]
    assert allowed_tokens(bytes(bytearray(first)), vocab) is got  # equal bytes, another object: the kept array
    assert [allows(first, t) for t in (2, 3, 63, 64, 99)] == [False, True, False, True, True]
    for t in range(masks._ALLOWED_KEPT + 5):  # more distinct masks than it keeps
        allowed_tokens(pack_allowed_tokens([t % vocab, (t + 1) % vocab, t // vocab], vocab), vocab)
    assert len(masks._allowed) == masks._ALLOWED_KEPT
    again = allowed_tokens(first, vocab)
    assert again is not got and np.array_equal(again, got)
    with pytest.raises(InvalidInput, match="allows no token"):  # validation reads the bytes themselves
        validate_token_choice(TokenChoice(allowed_token_bitmask=bytes(16)), vocab)
    with pytest.raises(InvalidInput, match="allows no token"):
        validate_token_choice(TokenChoice(allowed_token_bitmask=bytes(16)), vocab)
