"""The CUDA-graph decode step's padding (``engine/graphs.py``), checked on the CPU with
its steps run eagerly (``capture=False``): the batch padded to its bucket and the
block tables to a power of two give each sequence transformers' logits, write
each token's key and value where the plain forward does, and touch no block a
sequence holds but the one it writes; what a graph cannot run goes the plain way."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.graphs import DecodeGraphs
from ferrum_rpc.types import DecodeInput, LogitsPolicy
from tests.conftest import hf_oracle, oracle_rows

FULL = LogitsPolicy.full()
ATOL = 1e-4


def _executor(model_dir, graphs: bool) -> TorchExecutor:
    ex = TorchExecutor.from_path("tiny", model_dir, ExecutorConfig(kv_tokens=512, block_size=4, step_ops="eager",
                                                                 batch_invariant="off", max_batch_size=6))
    if graphs:
        ex.graphs = DecodeGraphs(ex.model, ex.pool, 6, -(-ex.max_seq_len // 4), capture=False)
    return ex


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_padded_decode_steps_equal_transformers_and_write_the_same_kv(arch, tiny_llama_dir, tiny_qwen3_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    oracle = hf_oracle(model_dir, arch)
    padded, plain = _executor(model_dir, True), _executor(model_dir, False)
    prompts = [[5, 17, 101, 3, 250, 42, 7], [9, 300, 11], [64, 2, 77, 8, 8, 13, 21, 34, 55, 1, 2, 3, 4, 5]]
    ids = [list(p) for p in prompts]
    handles = {ex: [ex.prefill(p, None, LogitsPolicy.argmax()).kv_cache for p in prompts] for ex in (padded, plain)}
    for step in range(14):  # tables grow past 4 and 8 blocks: the width bucket changes under way
        live = [0, 1, 2] if step % 3 else [2, 0]  # batches of 3 (bucket 4) and 2
        tokens = [int(oracle_rows(oracle, ids[i])[-1].argmax()) for i in live]
        outs = {}
        for ex in (padded, plain):
            outs[ex] = ex.batch_decode([DecodeInput(t, handles[ex][i]) for t, i in zip(tokens, live)], FULL)
            for i, out in zip(live, outs[ex]):
                handles[ex][i] = out.kv_cache
        for t, i in zip(tokens, live):
            ids[i].append(t)
        for k, i in enumerate(live):
            np.testing.assert_allclose(outs[padded][k].logits.values[0], oracle_rows(oracle, ids[i])[-1],
                                       atol=ATOL, rtol=0)
    assert {key[0] for key in padded.graphs.graphs} == {2, 4} and len({key[1] for key in padded.graphs.graphs}) >= 2
    # every sequence's keys and values, where its blocks hold them, as the plain forward wrote them
    for i, p in enumerate(ids):
        for ex_a, ex_b in ((padded, plain),):
            a, b = handles[ex_a][i], handles[ex_b][i]
            for pool_a, pool_b in ((ex_a.pool.k, ex_b.pool.k), (ex_a.pool.v, ex_b.pool.v)):
                rows_a = pool_a[:, list(a.block_table.block_ids)].flatten(1, 2)[:, :len(p)]
                rows_b = pool_b[:, list(b.block_table.block_ids)].flatten(1, 2)[:, :len(p)]
                torch.testing.assert_close(rows_a, rows_b, atol=1e-5, rtol=0)


def test_steps_a_graph_cannot_run_take_the_plain_forward(tiny_llama_dir):
    ex = _executor(tiny_llama_dir, True)
    taken = []
    real = ex.graphs.forward
    ex.graphs.forward = lambda steps: taken.append(len(steps)) or real(steps)
    handle = ex.prefill([5, 17, 101], None, LogitsPolicy.argmax()).kv_cache  # a prompt: not a decode step
    assert taken == []
    out = ex.decode(9, handle, FULL)
    assert taken == [1]
    ex.forward_verify([4, 44], out.kv_cache, FULL)  # two tokens a sequence: plain
    assert taken == [1]
    handles = [ex.prefill([7 + i, 1], None, LogitsPolicy.argmax()).kv_cache for i in range(6)]
    assert taken == [1]
    ex.batch_decode([DecodeInput(3, h) for h in handles[:6]], FULL)  # the largest bucket
    assert taken == [1, 6] and ex.graphs.takes([]) is False


def test_the_setting_is_auto_or_off():
    from ferrum_rpc.errors import StartupError

    assert ExecutorConfig().cuda_graphs == "auto" and ExecutorConfig(cuda_graphs="off").cuda_graphs == "off"
    with pytest.raises(StartupError, match="cuda_graphs must be auto or off"):
        ExecutorConfig(cuda_graphs="on")


def test_a_failed_graph_step_leaves_every_sequence_as_it_was(tiny_llama_dir, monkeypatch):
    from tests.conftest import executor_snapshot as snapshot
    from tests.component.engine.test_append_path import Boom, fail_lm_head

    ex = _executor(tiny_llama_dir, True)
    ha = ex.prefill([1, 2, 3, 4, 5, 6], None, LogitsPolicy.argmax()).kv_cache
    child, = ex.fork_cache(ha, 1)  # shares ha's blocks: the step's write copies the shared one first
    before = snapshot(ex)
    fail_lm_head(ex, monkeypatch)  # inside the graph's step
    with pytest.raises(Boom):
        ex.batch_decode([DecodeInput(17, ha), DecodeInput(18, child)], FULL)
    assert snapshot(ex) == before
    monkeypatch.undo()
    out = ex.batch_decode([DecodeInput(17, ha), DecodeInput(18, child)], FULL)  # and both still serve
    assert [o.kv_cache.sequence_length for o in out] == [7, 7] and ex.graphs.graphs
