"""The model worker on its own (a real tiny executor, no gRPC): stop() leaves no
future unresolved, and a job nobody waits for is never run."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from ferrum_rpc.errors import DeadlineExceeded, Draining
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.types import LogitsPolicy
from tests.waiting import wait_for


@pytest.fixture
def worker(tiny_llama_dir):
    config = ExecutorConfig(kv_tokens=512, block_size=4, prefill_chunk=4)
    w = ModelWorker(functools.partial(TorchExecutor.from_path, "tiny", tiny_llama_dir, config))
    w.loaded.result(timeout=60)
    yield w
    w.stop(timeout=10)


def hold(worker: ModelWorker) -> threading.Event:
    """Occupies the worker thread until the returned gate is set."""
    gate = threading.Event()
    held = worker.submit(gate.wait, 30)
    wait_for(held.running, 30, "the worker to run the holding job")
    return gate


def test_stop_finishes_a_chunked_job_requeued_behind_it(worker):
    gate = hold(worker)
    chunked = worker.submit_prefill(list(range(1, 30)), None, LogitsPolicy.argmax())  # 8 slices
    stopper = threading.Thread(target=worker.stop, kwargs={"timeout": 30})
    stopper.start()  # the stop sentinel is queued behind the prefill's first slice
    wait_for(lambda: worker.stopping, 30, "the worker to start stopping")
    gate.set()
    out = chunked.result(timeout=30)  # once hung forever: later slices queued behind the sentinel
    assert out.kv_cache.sequence_length == 29
    stopper.join(timeout=30)
    assert not stopper.is_alive()
    late = worker.submit(lambda: 1)
    with pytest.raises(Draining):
        late.result(timeout=1)


def test_a_job_whose_deadline_passed_in_the_queue_is_not_run(worker):
    gate = hold(worker)
    ran = []
    deadline = time.monotonic() + 0.05
    expired = worker.submit(ran.append, 1, deadline=deadline)
    wait_for(lambda: time.monotonic() > deadline, 10, "the queued job's deadline to pass")
    gate.set()
    with pytest.raises(DeadlineExceeded):
        expired.result(timeout=10)
    assert ran == []
    assert len(worker.executor.kv) == 0


def test_a_flooding_tenant_does_not_starve_another_tenants_decode(tiny_llama_dir):
    """Fairness: decodes are batched round-robin by tenant.  40 queued decodes of
    tenant "a" and then one of tenant "b", at most 4 sequences a forward: b's
    runs in the first forward (first come, first served would make it the 11th)."""
    from ferrum_rpc.types import DecodeInput

    config = ExecutorConfig(kv_tokens=2048, block_size=4, max_batch_size=4)
    w = ModelWorker(functools.partial(TorchExecutor.from_path, "tiny", tiny_llama_dir, config))
    ex = w.loaded.result(timeout=60)
    policy = LogitsPolicy.argmax()
    try:
        handles = {}
        for tenant, count in (("a", 40), ("b", 1)):
            handles[tenant] = [w.submit_prefill([i + 1, 2], None, policy, tenant=tenant).result(timeout=30).kv_cache
                               for i in range(count)]
        gate = hold(w)
        start = ex.stats.forwards
        ran_in: dict[str, list[int]] = {"a": [], "b": []}
        jobs = []
        for tenant in ("a", "b"):
            for h in handles[tenant]:
                future = w.submit_decode([DecodeInput(7, h)], policy, tenant=tenant)  # queued behind the gate
                future.add_done_callback(lambda f, t=tenant: ran_in[t].append(ex.stats.forwards - start))
                jobs.append(future)
        gate.set()
        for future in jobs:
            assert future.result(timeout=60)[0].kv_cache.sequence_length == 3
        assert ran_in["b"] == [1]
        assert max(ran_in["a"]) == 11 and sorted(ran_in["a"]).count(1) == 3  # a got the other 3 seats
    finally:
        w.stop(timeout=10)


def test_a_released_sequence_is_not_waited_for(worker):
    """The worker waits briefly for the last second's decoders before a forward; a
    sequence released since will never call again, and waiting for it cost every
    other decoder a quarter of a forward per step (bench.decode_throughput, batch 1)."""
    from ferrum_rpc.types import DecodeInput

    greedy = LogitsPolicy.argmax()
    gone = worker.submit_prefill([1, 2, 3], None, greedy).result()
    gone = worker.submit_decode([DecodeInput(4, gone.kv_cache)], greedy).result()[0].kv_cache
    assert gone.cache_id in worker.scheduler.decoders
    worker.submit(worker.executor.release_cache, gone.cache_id).result()
    live = worker.submit_prefill([5, 6, 7], None, greedy).result().kv_cache
    worker.submit_decode([DecodeInput(8, live)], greedy).result()
    assert gone.cache_id not in worker.scheduler.decoders and live.cache_id in worker.scheduler.decoders


def test_status_counts_queued_model_work_not_bookkeeping(worker):
    """GetStatus's queue_depth (``work_queued``) counts prompts and decodes only: a status
    read while a new client's KV-event snapshot was queued made that replica look busy
    and replica placement passed it over (tests/system/test_replicas.py, a flaky spread)."""
    gate = hold(worker)
    try:
        bookkeeping = worker.submit(len, [])
        assert worker.queue_depth == 1 and worker.work_queued == 0
        prompt = worker.submit_prefill([1, 2, 3], None, LogitsPolicy.argmax())
        assert worker.queue_depth == 2 and worker.work_queued == 1
    finally:
        gate.set()
    assert bookkeeping.result(timeout=30) == 0 and prompt.result(timeout=30).kv_cache.sequence_length == 3
    assert worker.work_queued == 0
