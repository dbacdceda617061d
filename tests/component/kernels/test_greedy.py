"""greedy_rows (csrc/greedy.cpp) against the torch ops token choice took before it, on
every inner-loop path this CPU runs; and token choice over it: a greedy row's token and
logprob bits the same alone and beside other rows, sampled ones included."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ferrum_rpc.server.choice.sampling import choose_tokens
from ferrum_rpc.server.kernels import fused
from ferrum_rpc.types import LogprobsMode, TokenChoice


@pytest.fixture(scope="module")
def ops():
    ok, why = fused.probe_fused(torch.float32)
    assert ok, f"the fused ops should build and agree on this machine: {why}"
    return torch.ops.ferrum_fused


def rows(gen: torch.Generator, r: int, v: int) -> torch.Tensor:
    x = torch.randn(r, v, generator=gen) * 6
    x[:, ::5] = -math.inf if v > 5 else x[:, ::5]  # masked tokens
    if v > 3:
        x[0, 1] = x[0, 3] = x[0].max() + 1  # a tie for the largest: the first index wins
    return x


@pytest.mark.parametrize("v", [1, 7, 8, 13, 100, 49152])
def test_greedy_rows_matches_amax_amin_argmax_and_logsumexp(ops, isa, v):
    x = rows(torch.Generator().manual_seed(v), 5, v)
    first, largest, smallest, log_norm = ops.greedy_rows(x)
    assert torch.equal(largest, x.amax(-1)) and torch.equal(smallest, x.amin(-1))
    assert first.tolist() == np.argmax(x.numpy(), axis=-1).tolist()
    torch.testing.assert_close(log_norm, torch.logsumexp(x.double(), -1).float(), rtol=2e-6, atol=1e-5)


def test_a_nan_makes_its_row_nan_and_leaves_the_others(ops, isa):
    x = rows(torch.Generator().manual_seed(1), 3, 1000)
    x[1, 517] = math.nan
    first, largest, smallest, log_norm = ops.greedy_rows(x)
    assert all(math.isnan(t[1].item()) for t in (largest, smallest, log_norm))
    alone = ops.greedy_rows(x[[0, 2]])
    for got, want in zip((first, largest, smallest, log_norm), alone):
        assert torch.equal(got[[0, 2]], want)


def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(ops, isa):
    x = rows(torch.Generator().manual_seed(2), 40, 49152)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.greedy_rows(x)
        torch.set_num_threads(2)
        two = ops.greedy_rows(x)
    finally:
        torch.set_num_threads(threads)
    singles = [ops.greedy_rows(x[i:i + 1]) for i in (0, 17, 39)]
    for k in range(4):
        assert torch.equal(one[k], two[k])
        for i, single in zip((0, 17, 39), singles):
            assert torch.equal(one[k][i:i + 1], single[k])


def test_greedy_rows_refuses_what_it_does_not_run(ops):
    with pytest.raises(RuntimeError, match="greedy_rows"):
        ops.greedy_rows(torch.randn(2, 8).double())
    with pytest.raises(RuntimeError, match="greedy_rows"):
        ops.greedy_rows(torch.randn(2, 0))


def test_token_choice_over_greedy_rows_is_the_same_alone_and_in_a_mixed_batch(ops):
    """choose_tokens takes greedy_rows for every greedy row (loaded here): a greedy row's
    token and logprob bits, RAW and PROCESSED, are the same alone, in an all-greedy
    batch, beside sampled and penalised rows and beside a row of NaN; and they are the
    model's log-softmax."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(6, 49152, generator=gen) * 4
    x[4, 9] = math.nan
    greedy = TokenChoice(temperature=0.0)
    processed = TokenChoice(temperature=0.0, logprobs_mode=LogprobsMode.PROCESSED)
    choices = [greedy, TokenChoice(temperature=0.8, seed=1), processed,
               TokenChoice.greedy(repetition_penalty=1.3), greedy, TokenChoice(top_p=0.5, seed=2)]
    mixed = choose_tokens(x, choices, list(range(6)))
    assert mixed.failed == (4,)
    same = choose_tokens(x[[0, 2]], [greedy, processed], [0, 2])
    for i, j in ((0, 0), (2, 1)):
        alone = choose_tokens(x[i:i + 1], [choices[i]], [i])
        for got in (mixed.token_ids[i], same.token_ids[j], alone.token_ids[0]):
            assert int(got) == int(x[i].argmax())
        assert mixed.logprobs[i].item() == same.logprobs[j].item() == alone.logprobs[0].item()
        want = torch.log_softmax(x[i].double(), -1)[int(x[i].argmax())].item()
        assert abs(alone.logprobs[0].item() - want) < 1e-5
