"""Decode-ahead runs in bursts (engine/burst.py, engine/runs.py), on a real tiny executor:
a burst's tokens, logprobs and lengths are a plain step's (greedy, seeded sampling,
bias and top logprobs); a stop token ends it at its forward, a stop message at the
forward it was seen; a call queued meanwhile is served before the run ends; a row
that is not finite, or a pool without room, fails its own run alone and leaves every
sequence as it was; nothing holds a block once the sequences go."""

from __future__ import annotations

import functools

import pytest

from ferrum_rpc.errors import KvCapacityExhausted, NonFiniteLogits
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.ahead import Finish
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.types import DecodeInput, TokenChoice
from tests.component.engine.test_ahead_runs import drain
from tests.waiting import wait_for

GREEDY = TokenChoice.greedy()


def start(tiny_llama_dir, **config) -> ModelWorker:
    config = ExecutorConfig(**{"kv_tokens": 4096, "block_size": 8, "max_batch_size": 4, "tenant_ahead_sequences": 4,
                               **config})
    w = ModelWorker(functools.partial(TorchExecutor.from_path, "tiny", tiny_llama_dir, config))
    w.loaded.result(timeout=60)
    return w


@pytest.fixture(params=[("float32", "none"), ("bfloat16", "w4a8")], ids=["float32", "w4a8"])
def worker(request, tiny_llama_dir):
    dtype, quantize = request.param
    w = start(tiny_llama_dir, dtype=dtype, quantize=quantize)
    yield w
    w.stop(timeout=10)


def prompt(worker: ModelWorker, ids: list[int], choice: TokenChoice = GREEDY, tenant: str = "") -> DecodeInput:
    out = worker.submit_prefill(ids, None, None, tenant=tenant, choice=choice).result(timeout=30)
    return DecodeInput(out.chosen.token_id, out.kv_cache, choice)


def back(worker: ModelWorker, item: DecodeInput, tenant: str = "") -> None:
    """Truncates the item's sequence back to the item's length (a run went past it)."""
    handle = worker.executor.handle(worker.executor.kv.get(item.kv_cache.cache_id))
    worker.submit(worker.executor.truncate_kv, handle, item.kv_cache.sequence_length, tenant).result()


def plain_steps(worker: ModelWorker, item: DecodeInput, n: int, tenant: str = "") -> list:
    """``n`` unary decode steps from ``item`` (plain steps; a unary decoder holds bursts
    off for a second), then the sequence truncated back."""
    back(worker, item, tenant)
    outs = []
    for _ in range(n):
        (out,) = worker.submit_decode([item], None, tenant=tenant).result(timeout=30)
        outs.append(out)
        item = DecodeInput(out.chosen.token_id, out.kv_cache, item.token_choice)
    worker.submit(worker.executor.truncate_kv, outs[-1].kv_cache, item.kv_cache.sequence_length - n, tenant).result()
    return outs


def lengths(worker: ModelWorker) -> dict[str, int]:
    return worker.submit(lambda: {cid: s.length for cid, s in worker.executor.kv.snapshot().sequences.items()}).result()


def seen(out) -> tuple:
    return out.chosen, out.kv_cache.sequence_length


CHOICES = {
    "greedy": GREEDY,  # the fused greedy pass alone
    "sampled": TokenChoice(temperature=0.8, top_k=50, top_p=0.9, seed=11, top_logprobs=3),  # drawn at each position
    "shaped": TokenChoice(temperature=0.0, logit_bias={7: 2.5, 40: -1.0}, top_logprobs=2),  # greedy, biased
}


@pytest.mark.parametrize("choice", CHOICES.values(), ids=CHOICES.keys())
def test_a_burst_gives_what_plain_steps_give(worker, choice):
    # lengths 3 and 10: the first bursts start inside a block, and the rows' blocks end at different forwards
    items = [prompt(worker, [5, 6, 7], choice), prompt(worker, [9, 3, 4, 4, 4, 4, 4, 4, 4, 1], choice)]
    before = worker.executor.stats.burst_forwards
    run = worker.start_ahead(items, 21, frozenset(), "", None, bound=64)
    entries = drain(run)
    assert worker.executor.stats.burst_forwards - before >= 15  # one-slot rooms (a block's last position) run plain
    assert len(entries) == 21 and [e.finish for e in entries[-1]] == [Finish.LENGTH] * 2
    for i, item in enumerate(items):
        ran = [seen(e.out) for entry in entries for e in entry if e.index == i]
        assert ran == [seen(out) for out in plain_steps(worker, item, 21)]


def test_without_the_fused_greedy_op_a_greedy_burst_chooses_through_choose_tokens(worker, monkeypatch):
    import ferrum_rpc.server.engine.burst as burst

    monkeypatch.setattr(burst, "greedy_op_loaded", lambda: False)  # as where the kernels did not build
    item = prompt(worker, [5, 6, 7])
    before = worker.executor.stats.burst_forwards
    entries = drain(worker.start_ahead([item], 12, frozenset(), "", None, bound=64))
    assert worker.executor.stats.burst_forwards > before
    assert [seen(e[0].out) for e in entries] == [seen(o) for o in plain_steps(worker, item, 12)]


def test_runs_of_two_tenants_burst_together_and_each_gets_its_plain_tokens(worker):
    """Two runs share each burst (the burst's rows are both runs'), the first ending at its
    limit mid-way; the second, paused by a small queue bound, rejoins when its consumer
    takes. Each run's entries are its own sequences', as plain steps give them."""
    choice = CHOICES["sampled"]
    short = prompt(worker, [5, 6, 7], choice, tenant="a")
    pair = [prompt(worker, [9, 3, 4, 4, 4], choice, tenant="b"), prompt(worker, [2, 2], choice, tenant="b")]
    first = worker.start_ahead([short], 6, frozenset(), "a", None, bound=64)
    second = worker.start_ahead(pair, 19, frozenset(), "b", None, bound=3)
    got_first, got_second = drain(first), drain(second)
    assert [len(e) for e in got_first] == [1] * 6 and [len(e) for e in got_second] == [2] * 19
    assert worker.executor.stats.burst_forwards > 0
    assert [seen(e[0].out) for e in got_first] == [seen(o) for o in plain_steps(worker, short, 6, "a")]
    for i, item in enumerate(pair):
        ran = [seen(e.out) for entry in got_second for e in entry if e.index == i]
        assert ran == [seen(o) for o in plain_steps(worker, item, 19, "b")]


def test_a_stop_token_ends_the_burst_at_its_forward_and_nothing_is_left_held(worker):
    item = prompt(worker, [11, 12, 13])
    tokens = [entry[0].out.chosen.token_id for entry in drain(worker.start_ahead([item], 12, frozenset(), "", None))]
    back(worker, item)
    stop = next((j for j in range(2, 12) if tokens[j] not in tokens[:j]), None)
    if stop is None:
        pytest.skip("the tiny model repeats one token here")
    entries = drain(worker.start_ahead([item], 50, frozenset({tokens[stop]}), "", None, bound=64))
    assert [entry[0].out.chosen.token_id for entry in entries] == tokens[:stop + 1]
    assert entries[-1][0].finish is Finish.STOP_TOKEN
    assert lengths(worker)[item.kv_cache.cache_id] == item.kv_cache.sequence_length + stop + 1
    worker.submit(worker.executor.release_cache, item.kv_cache.cache_id).result()
    kv = worker.executor.kv
    assert worker.submit(lambda: kv.num_free + kv.num_cached_free).result() == kv.num_blocks


def test_a_stop_ends_the_run_at_the_forward_it_was_seen_with_every_token_chosen_until_then(worker):
    item = prompt(worker, [5, 6, 7])
    run = worker.start_ahead([item], 200, frozenset(), "", None, bound=1000)
    wait_for(lambda: run.queued, 30, "the run's first entry", poll_s=0.0005)  # stopped well before 200
    run.stop()
    entries = drain(run)
    assert entries[-1][0].finish is Finish.STOPPED and len(entries) < 200
    assert lengths(worker)[item.kv_cache.cache_id] == item.kv_cache.sequence_length + len(entries)
    ran = [seen(entry[0].out) for entry in entries]
    assert ran == [seen(o) for o in plain_steps(worker, item, len(ran))]


def test_a_call_queued_during_a_burst_is_served_before_the_run_ends(worker):
    item, other = prompt(worker, [5, 6, 7]), prompt(worker, [8, 9])
    run = worker.start_ahead([item], worker.executor.max_seq_len - 4, frozenset(), "", None, bound=1000)
    wait_for(lambda: worker.executor.stats.burst_forwards, 30, "the run's first burst", poll_s=0.0005)
    (out,) = worker.submit_decode([other], None).result(timeout=30)
    assert run.running  # the decode waited for one burst at most, not for the run
    assert out.kv_cache.sequence_length == other.kv_cache.sequence_length + 1
    entries = drain(run)
    ran = [seen(entry[0].out) for entry in entries]
    assert ran == [seen(o) for o in plain_steps(worker, item, len(ran))]


def test_a_row_that_is_not_finite_fails_its_own_run_alone(worker, caplog):
    bad, good = prompt(worker, [5, 17, 101, 3]), prompt(worker, [9, 30, 11])
    ex = worker.executor

    def corrupt():  # the bad sequence's keys are NaN: its rows' logits are not finite
        ex.pool.k[:, ex.kv.get(bad.kv_cache.cache_id).block_ids] = float("nan")
    worker.submit(corrupt).result()
    before = lengths(worker)
    failing = worker.start_ahead([bad], 20, frozenset(), "", None, bound=64)
    going = worker.start_ahead([good], 20, frozenset(), "", None, bound=64)
    with pytest.raises(NonFiniteLogits):
        drain(failing)
    assert "no token can be chosen for" in caplog.text  # the burst gave its forward to a plain step
    entries = drain(going)
    assert lengths(worker)[bad.kv_cache.cache_id] == before[bad.kv_cache.cache_id]
    assert [seen(entry[0].out) for entry in entries] == [seen(o) for o in plain_steps(worker, good, 20)]


def test_a_pool_without_room_for_the_next_block_fails_the_run_undone(tiny_llama_dir):
    worker = start(tiny_llama_dir, kv_tokens=32)  # four blocks of 8
    try:
        item = prompt(worker, list(range(1, 11)))  # two blocks
        prompt(worker, list(range(20, 35)))  # the other two
        before = lengths(worker)
        run = worker.start_ahead([item], 20, frozenset(), "", None, bound=64)
        with pytest.raises(KvCapacityExhausted):
            drain(run)  # bursts up to position 16, where a third block is needed
        assert lengths(worker) == before and worker.ahead == {}
    finally:
        worker.stop(timeout=10)
