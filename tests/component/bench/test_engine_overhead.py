"""bench.engine_overhead: the engine's decode-ahead run (in bursts and in plain steps) and
the bare loop of the same model calls choose the same tokens, across KV blocks, and
leave no sequence behind."""

from __future__ import annotations

import functools

import pytest

from bench.engine_overhead import CHOICES, bare_run, engine_run, turns
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker


@pytest.fixture
def worker(tiny_llama_dir):
    config = ExecutorConfig(kv_tokens=512, block_size=4)
    w = ModelWorker(functools.partial(TorchExecutor.from_path, "tiny", tiny_llama_dir, config))
    w.loaded.result(timeout=60)
    yield w
    w.stop(timeout=10)


def test_the_engine_and_the_bare_loop_choose_the_same_tokens_and_release_everything(worker):
    prompt = [5, 17, 101, 3, 250, 42, 9]
    _, engine_tokens = engine_run(worker, prompt, 21)  # more than one response's worth of forwards
    _, bare_tokens = worker.submit(bare_run, worker.executor, prompt, 21).result(timeout=60)
    assert len(engine_tokens) == 21 and engine_tokens == bare_tokens
    stats = worker.executor.stats
    bursts = stats.burst_forwards
    engine_s, plain_s, bare_s = turns(worker, [7, 8, 9, 200, 31], 9)
    assert engine_s > 0 and plain_s > 0 and bare_s > 0 and worker.bursts and stats.burst_forwards > bursts
    worker.bursts, bursts = False, stats.burst_forwards  # as turns runs the plain one
    assert engine_run(worker, [7, 8, 9, 200, 31], 9)[1] and stats.burst_forwards == bursts
    worker.bursts = True
    assert turns(worker, [7, 8, 9, 200, 31], 9, CHOICES["sampled"])[0] > 0  # a seeded draw: the same tokens too
    assert len(worker.executor.kv) == 0  # every sequence released


def test_turns_fails_loudly_when_the_tokens_differ(worker, monkeypatch):
    import bench.engine_overhead as bench

    real = bench.bare_run
    monkeypatch.setattr(bench, "bare_run", lambda *args: (lambda s, t: (s, [x + 1 for x in t]))(*real(*args)))
    with pytest.raises(AssertionError, match="the engine chose"):
        bench.turns(worker, [5, 6, 7], 5)
