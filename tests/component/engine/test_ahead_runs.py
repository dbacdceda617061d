"""Decode-ahead runs inside the engine (a real tiny executor, no gRPC): the run gives the
tokens step-by-step decoding gives, stops where it should, pauses on a full queue
(several forwards taken at once, in order, unpause it), and a cancelled, failed or drained run leaves every sequence where it found it."""

from __future__ import annotations

import dataclasses
import functools
import threading
import time

import pytest

from ferrum_rpc.errors import Cancelled, DeadlineExceeded, Draining, SequenceLimitExceeded, TenantQuotaExceeded
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.ahead import Finish
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.types import DecodeInput, TokenChoice
from tests.waiting import wait_for

CHOICES = {"sampled": TokenChoice(temperature=1.0, seed=7),  # in bursts where the runs are alone (burst.py)
           "greedy": TokenChoice.greedy(),  # in bursts, the fused greedy pass
           "penalised": TokenChoice(temperature=1.0, seed=7, repetition_penalty=1.2)}  # plain steps only


@pytest.fixture(params=sorted(CHOICES))
def choice(request) -> TokenChoice:
    return CHOICES[request.param]


@pytest.fixture
def worker(tiny_llama_dir):
    config = ExecutorConfig(kv_tokens=4096, block_size=4, max_batch_size=4, tenant_ahead_sequences=3)
    w = ModelWorker(functools.partial(TorchExecutor.from_path, "tiny", tiny_llama_dir, config))
    w.loaded.result(timeout=60)
    yield w
    w.stop(timeout=10)


def prompt(worker: ModelWorker, choice: TokenChoice, ids: list[int], tenant: str = "") -> DecodeInput:
    out = worker.submit_prefill(ids, None, None, tenant=tenant, choice=choice).result(timeout=30)
    return DecodeInput(out.chosen.token_id, out.kv_cache, choice)


def drain(run, timeout: float = 30) -> list:
    """Takes every entry of a run, polling (the consumer's side, on a plain thread)."""
    entries: list = []

    def take_queued() -> bool:
        while not run.done and (entry := run.take()) is not None:
            entries.append(entry)
        return run.done

    # polled every millisecond: a run queues 2 forwards by default and waits for its consumer
    wait_for(take_queued, timeout, "the run to hand over its last entry", poll_s=0.001)
    return entries


def lengths(worker: ModelWorker) -> dict[str, int]:
    return {cid: seq.length for cid, seq in worker.executor.kv.snapshot().sequences.items()}


def test_a_run_gives_the_tokens_step_by_step_decoding_gives(worker, choice):
    items = [prompt(worker, choice, [5, 6, 7]), prompt(worker, choice, [9, 3])]
    run = worker.start_ahead(items, 6, frozenset(), "", None)
    entries = drain(run)
    assert len(entries) == 6 and [len(e) for e in entries] == [2] * 6  # one entry a forward
    ran = [[e.out.chosen.token_id for entry in entries for e in entry if e.index == i] for i in range(2)]
    assert [e.finish for e in entries[-1]] == [Finish.LENGTH, Finish.LENGTH]
    # the same sequences again, decoded one unary step at a time
    for i, ids in enumerate(([5, 6, 7], [9, 3])):
        item = prompt(worker, choice, ids)
        tokens = []
        for _ in range(6):
            out = worker.submit_decode([item], None).result(timeout=30)[0]
            tokens.append(out.chosen.token_id)
            item = DecodeInput(out.chosen.token_id, out.kv_cache, choice)
        assert tokens == ran[i]
        assert run.last[i].kv_cache.sequence_length == items[i].kv_cache.sequence_length + 6
    assert worker.ahead == {} and worker.runs.runs == []  # seats given back


def test_stop_token_stop_and_sequence_length_end_a_run(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    first = drain(worker.start_ahead([item], 4, frozenset(), "", None))
    worker.submit(worker.executor.truncate_kv, first[-1][0].out.kv_cache, item.kv_cache.sequence_length).result()
    token = first[1][0].out.chosen.token_id  # the run's second token ends an identical run there
    again = drain(worker.start_ahead([item], 50, frozenset({token}), "", None))
    assert len(again) == 2 and again[-1][0].finish is Finish.STOP_TOKEN
    worker.submit(worker.executor.truncate_kv, again[-1][0].out.kv_cache, item.kv_cache.sequence_length).result()

    run = worker.start_ahead([item], 4000, frozenset(), "", None)
    wait_for(run.take, 30, "the run's first entry")
    run.stop()
    assert drain(run)[-1][0].finish is Finish.STOPPED

    full = worker.executor.max_seq_len
    entries = drain(worker.start_ahead([prompt(worker, choice, [1, 2])], 4000, frozenset(), "", None), timeout=120)
    assert entries[-1][0].finish is Finish.MAX_SEQUENCE_LENGTH
    assert entries[-1][0].out.kv_cache.sequence_length == full


def test_a_run_whose_queue_is_full_pauses_until_its_consumer_takes(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    start = item.kv_cache.sequence_length
    run = worker.start_ahead([item], 20, frozenset(), "", None, bound=2)
    wait_for(lambda: worker.ahead_paused, 30, "one paused run", until=lambda n: n == 1)
    other = prompt(worker, choice, [9, 3])
    worker.submit_decode([other], None).result(timeout=30)  # a paused run joins no forward, not this one
    assert lengths(worker)[item.kv_cache.cache_id] == start + 2 and run.paused
    assert run.take() is not None
    wait_for(lambda: lengths(worker)[item.kv_cache.cache_id], 30, "the unpaused run's next forward",
             until=lambda n: n >= start + 3)
    drain(run)
    assert run.last[0].kv_cache.sequence_length == start + 20


def test_take_some_takes_the_oldest_forwards_in_order_and_unpauses_the_run(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    start = item.kv_cache.sequence_length
    run = worker.start_ahead([item], 12, frozenset(), "", None, bound=5)
    wait_for(lambda: run.paused, 30, "the run to pause on its full queue")
    assert run.queued == 5
    first = run.take_some(3)
    assert [entry[0].out.kv_cache.sequence_length for entry in first] == [start + 1, start + 2, start + 3]
    wait_for(lambda: lengths(worker)[item.kv_cache.cache_id], 30, "the run to go on (no longer paused)",
             until=lambda n: n >= start + 6)
    rest = drain(run)
    assert [e[0].out.kv_cache.sequence_length for e in first + rest] == list(range(start + 1, start + 13))
    assert rest[-1][0].finish is Finish.LENGTH and run.take_some(4) == [] and run.done


def test_a_cancelled_run_changes_nothing(worker, choice):
    items = [prompt(worker, choice, [5, 6, 7]), prompt(worker, choice, [8])]
    before = lengths(worker)
    run = worker.start_ahead(items, 200, frozenset(), "", None, bound=1000)
    wait_for(lambda: lengths(worker), 30, "the run's first forward", until=lambda now: now != before)
    run.cancel()
    with pytest.raises(Cancelled):
        drain(run)
    assert worker.submit(lambda: lengths(worker)).result(timeout=10) == before  # undone before that job
    assert worker.ahead == {}


def test_a_finished_run_cancelled_before_its_last_entry_is_taken_is_undone(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    before = lengths(worker)
    run = worker.start_ahead([item], 3, frozenset(), "", None)

    def take_all_but_the_last() -> bool:
        while len(run._entries) > 1:
            run.take()
        return not run.running

    wait_for(take_all_but_the_last, 30, "the run to finish with its last entry untaken")
    run.cancel()
    assert worker.submit(lambda: lengths(worker)).result(timeout=10) == before


def test_a_run_taken_to_its_end_stands_after_a_cancel(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    run = worker.start_ahead([item], 3, frozenset(), "", None)
    drain(run)
    run.cancel()  # the consumer owns the results now: nothing is undone
    assert worker.submit(lambda: lengths(worker)).result(timeout=10)[item.kv_cache.cache_id] == \
        item.kv_cache.sequence_length + 3


def test_seats_are_bounded_per_tenant_and_in_all(worker, choice):
    items = [prompt(worker, choice, [i + 1, 2], tenant="a") for i in range(4)]
    others = [prompt(worker, choice, [i + 1, 3], tenant="b") for i in range(2)]
    with pytest.raises(TenantQuotaExceeded):
        worker.start_ahead(items, 5, frozenset(), "a", None)  # the tenant's cap is 3
    gate = threading.Event()
    held = worker.submit(gate.wait, 30)  # keeps the run from finishing while seats are counted
    wait_for(held.running, 30, "the worker to run the holding job")
    run = worker.start_ahead(items[:3], 5, frozenset(), "a", None)
    assert worker.ahead == {"a": 3}
    with pytest.raises(SequenceLimitExceeded):
        worker.start_ahead(others, 5, frozenset(), "b", None)  # 3 + 2 sequences, --max-batch 4
    gate.set()
    drain(run)
    assert worker.ahead == {}
    drain(worker.start_ahead(others, 5, frozenset(), "b", None))


def test_stopping_the_worker_ends_a_paused_run_and_undoes_it(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    before = lengths(worker)
    run = worker.start_ahead([item], 50, frozenset(), "", None, bound=1)
    wait_for(lambda: run.paused, 30, "the run to pause on its full queue")
    worker.stop(timeout=10)
    with pytest.raises(Draining):
        drain(run)
    assert lengths(worker) == before


def test_a_forward_that_fails_for_the_run_ends_it_undone(worker, choice):
    item = prompt(worker, choice, [5, 6, 7])
    before = lengths(worker)
    stale = dataclasses.replace(item.kv_cache, sequence_length=item.kv_cache.sequence_length + 5)
    run = worker.start_ahead([item, DecodeInput(item.token_id, stale, choice)], 5, frozenset(), "", None)
    with pytest.raises(Exception) as failed:
        drain(run)
    assert not isinstance(failed.value, AssertionError)
    assert lengths(worker) == before and worker.ahead == {}


def test_a_run_past_its_deadline_ends_undone(worker, choice):
    """The worker is held while the run's deadline passes: it is ended before its first forward."""
    item = prompt(worker, choice, [5, 6, 7])
    before = lengths(worker)
    gate = threading.Event()
    held = worker.submit(gate.wait, 30)
    wait_for(held.running, 30, "the worker to run the holding job")
    deadline = time.monotonic() + 0.05
    run = worker.start_ahead([item], 4000, frozenset(), "", deadline, bound=10_000)
    wait_for(lambda: time.monotonic() > deadline, 10, "the run's deadline to pass")
    gate.set()
    with pytest.raises(DeadlineExceeded):
        drain(run, timeout=60)
    assert worker.submit(lambda: lengths(worker)).result(timeout=10) == before and worker.ahead == {}
