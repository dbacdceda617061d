"""The decode crossover is timed once per model, dtype, kernels, CPU, torch and thread
count, stored under the cache folder, and read back on the next start; a change to
anything it depends on, or ``--remeasure``, times it again."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine import crossover
from ferrum_rpc.server.engine.executor import TorchExecutor
from tests.conftest import TEST_DEVICE, running_server

pytestmark = pytest.mark.timeout(240)

MEASURED = "step ms by batch"
STORED = "stored in"


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The crossover's folder in tmp_path (the rest of the cache folder, the built
    kernels among it, stays where it is)."""
    monkeypatch.setattr(crossover, "cache_root", lambda: tmp_path)
    return tmp_path


def _executor(model_dir, **config) -> TorchExecutor:
    config = ExecutorConfig(**{"kv_tokens": 2048, "block_size": 4, "device": TEST_DEVICE, "max_batch_size": 8,
                               **config})
    return TorchExecutor.from_path("tiny", model_dir, config)


def test_the_crossover_is_measured_once_then_read_back(tiny_llama_dir, cache_home, caplog):
    caplog.set_level(logging.INFO)
    first = _executor(tiny_llama_dir)
    best = crossover.optimal_batch(first)
    assert best >= 1 and MEASURED in caplog.text
    stored = list((cache_home / "crossover").glob("*.json"))
    assert len(stored) == 1 and json.loads(stored[0].read_text())["optimal_batch_size"] == best

    caplog.clear()
    again = _executor(tiny_llama_dir)  # a restart: same model, dtype, kernels, CPU, threads
    assert crossover.optimal_batch(again) == best == again.optimal_batch_size
    assert STORED in caplog.text and MEASURED not in caplog.text

    caplog.clear()
    crossover.optimal_batch(again, remeasure=True)  # on request
    assert MEASURED in caplog.text


def test_a_change_it_depends_on_measures_again(tiny_llama_dir, cache_home, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    ex = _executor(tiny_llama_dir)
    key = crossover.crossover_key(ex)
    crossover.optimal_batch(ex)
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert crossover.crossover_key(ex)["threads"] != key["threads"]
    caplog.clear()
    crossover.optimal_batch(ex)
    assert MEASURED in caplog.text
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)

    other = _executor(tiny_llama_dir, dtype="bfloat16")
    assert crossover.cache_file(crossover.crossover_key(other)) != crossover.cache_file(key)
    caplog.clear()
    crossover.optimal_batch(other)
    assert MEASURED in caplog.text
    assert len(list((cache_home / "crossover").glob("*.json"))) == 3


def test_a_server_started_twice_times_the_crossover_once(tiny_llama_dir, cache_home, caplog):
    caplog.set_level(logging.INFO)
    sizes = []
    for _ in range(2):
        with running_server(tiny_llama_dir, max_batch_size=8, server_kwargs=dict(warmup=True)) as server:
            with ExecutorClient(server.target, timeout=30) as ex:
                sizes.append(ex.capabilities().optimal_batch_size)
    assert sizes[0] >= 1 and sizes[0] == sizes[1]
    assert caplog.text.count(MEASURED) == 1 and caplog.text.count(STORED) == 1
