"""Token choice across vocabulary slices (``server/parallel/choice.py``) on real gloo process
groups, against ``sampling.choose_tokens`` on the whole rows: the corners the tiny
degree-2 servers of tests/system/test_tensor_parallel.py do not reach (uneven slices, degree
3, the two-level draw of a vocabulary above 2048, a mask that leaves one rank no
token, top-k wider than a slice, ties across ranks)."""

from __future__ import annotations

import multiprocessing

import torch

from ferrum_rpc.server.choice.sampling import choose_tokens
from ferrum_rpc.rules import pack_allowed_tokens
from ferrum_rpc.server.parallel.group import free_port
from ferrum_rpc.server.parallel.choice import RowRequest
from ferrum_rpc.types import LogprobsMode, TokenChoice

ROWS = 10


def _cases(vocab: int) -> tuple[torch.Tensor, list[TokenChoice], list[list[int]], list[list[int]]]:
    torch.manual_seed(vocab)
    logits = torch.randn(ROWS, vocab) * 2
    low = pack_allowed_tokens(range(40), vocab)  # every allowed token on rank 0
    high = pack_allowed_tokens([vocab - 1, vocab - 5, vocab - 9], vocab)  # on the last rank
    processed = LogprobsMode.PROCESSED
    choices = [
        TokenChoice.greedy(repetition_penalty=1.4, presence_penalty=0.5, logit_bias={7: 3.0}, top_logprobs=4),
        TokenChoice.greedy(allowed_token_bitmask=high, top_logprobs=3, logprobs_mode=processed),
        TokenChoice.greedy(logit_bias={0: 100.0, vocab - 1: 100.0}),  # near-tie across ranks
        TokenChoice(temperature=0.9, top_k=vocab - 1, seed=1, top_logprobs=20),  # wider than a slice
        TokenChoice(temperature=1.1, top_k=40, top_p=0.7, min_p=0.05, seed=2, frequency_penalty=0.4,
                    top_logprobs=5, logprobs_mode=processed),
        TokenChoice(temperature=0.3, top_p=0.9, seed=3, top_logprobs=2),
        TokenChoice(temperature=1.0, allowed_token_bitmask=low, seed=4, top_logprobs=5),  # one rank, no token
        TokenChoice(temperature=0.7, min_p=0.2, seed=5, top_logprobs=3, logprobs_mode=processed),
        TokenChoice(temperature=1.3, seed=6, repetition_penalty=0.7, logit_bias={vocab - 1: -100.0}),
        TokenChoice(temperature=4.0, top_p=0.999, seed=7, top_logprobs=1),  # a wide nucleus: whole rows
    ]
    prompts = [[1, 2, 3, vocab - 2]] * ROWS
    outputs = [[5, 5, vocab - 1, 9, 5]] * ROWS
    return logits, choices, prompts, outputs


DEGREE = 3
CASES = {333: 3, 8200: 2}  # vocabulary -> rows expected on whole rows


def _rank(rank: int, port: int, out) -> None:
    import torch.distributed as dist

    from ferrum_rpc.server.models.config import ModelConfig
    from ferrum_rpc.server.parallel.shard import Shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=DEGREE)
    for vocab in CASES:
        config = ModelConfig("llama", vocab, 8, 8, 1, DEGREE, DEGREE, 4, 1e-6, 1e4, 64, True)
        shard = Shard(rank, DEGREE, config)
        logits, choices, prompts, outputs = _cases(vocab)
        requests = [RowRequest.of(i, c, 100 + i, p, o) for i, (c, p, o) in enumerate(zip(choices, prompts, outputs))]
        lo, hi = shard.vocab
        chosen = shard.choose(logits[:, lo:hi], requests)
        # numpy, pickled by value: a tensor would cross as a file descriptor this process closes on exit
        out.put((vocab, rank, *(t.numpy() for t in (chosen.token_ids, chosen.logprobs, chosen.top_token_ids,
                                                    chosen.top_logprobs)), shard.lm_head_bytes,
                 shard.choice_fallback_rows))
    dist.destroy_process_group()


def test_choices_across_slices_equal_the_whole_rows():
    """Three ranks, 333 tokens (uneven 111-token slices, small enough that top-k 332 and
    top-p's 256 candidates would cost more than the row) and 8,200 (two-level draw,
    slices not on 256-token blocks): the same tokens, logprobs and top logprobs (1e-5)
    on every rank as on whole rows.  Whole rows only for top-k past 4096 and a
    nucleus wider than 256 (and the costlier candidate lists at 333 tokens); the
    other rows gather under a quarter of a row each at 8,200 tokens."""
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(DEGREE)]
    for p in procs:
        p.start()
    got = [out.get(timeout=120) for _ in range(DEGREE * len(CASES))]
    for p in procs:
        p.join(30)
    assert sorted((vocab, rank) for vocab, rank, *_ in got) == [(v, r) for v in CASES for r in range(DEGREE)]
    for vocab, rank, tokens, logprobs, top_ids, top, sent, whole in got:
        tokens, logprobs, top_ids, top = map(torch.from_numpy, (tokens, logprobs, top_ids, top))
        logits, choices, prompts, outputs = _cases(vocab)
        want = choose_tokens(logits, choices, [100 + i for i in range(ROWS)], prompts, outputs)
        assert tokens.tolist() == want.token_ids.tolist()  # every rank knows every choice
        torch.testing.assert_close(logprobs, want.logprobs, atol=1e-5, rtol=0)
        for i, c in enumerate(choices):
            n = c.top_logprobs
            assert top_ids[i, :n].tolist() == want.top_token_ids[i, :n].tolist()
            torch.testing.assert_close(top[i, :n], want.top_logprobs[i, :n], atol=1e-5, rtol=0)
        assert whole == CASES[vocab]
        row_bytes = 4 * -(-vocab // DEGREE) * (DEGREE - 1)  # one row's slices from the other ranks
        if rank == 0 and vocab > 2048:
            assert sent - whole * row_bytes < ROWS * row_bytes / 4  # 256 candidates + 20 logprobs a row
