"""Capabilities and status as Ferrum's executor trait defines them, through a real
server: memory requirements that agree with the KV pool and the checkpoint's own
bytes, the measured decode crossover, operation counts and times, memory use,
and the executor state (including ERROR after a failure outside the table)."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.models.llama import FastLinear
from ferrum_rpc.types import ExecutorState
from tests.conftest import running_server


def checkpoint_bytes(model_dir) -> int:
    """Bytes of the checkpoint's tensors (a tied head is saved once, as the embedding)."""
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())


def test_memory_requirements_agree_with_the_pool_and_the_weights(tiny_llama_dir):
    with running_server(tiny_llama_dir, linear_kernel="aten") as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        caps, info = ex.capabilities(), ex.info()
        mem = caps.memory
        assert mem.num_layers == info.num_layers
        # the KV pool is exactly per-token-per-layer bytes x layers x (capacity + the scratch block
        # padded tokens of ragged batches write into)
        assert mem.kv_bytes_per_token_per_layer == 2 * info.num_kv_heads * info.head_dim * 4
        assert mem.kv_bytes_per_token_per_layer * mem.num_layers * (caps.kv_capacity_tokens + caps.kv_block_size) \
            == caps.kv_bytes
        # unpacked float32: the weights in memory are the checkpoint's bytes (fused projections are concatenations)
        assert mem.parameter_bytes == checkpoint_bytes(tiny_llama_dir)
        assert mem.activation_bytes_per_token >= info.vocab_size * 4 and mem.overhead_bytes > 0
        total = mem.calculate_total_memory(4, 100)
        assert total == mem.parameter_bytes + mem.overhead_bytes + 400 * (
            mem.kv_bytes_per_token_per_layer * mem.num_layers + mem.activation_bytes_per_token)
        assert "paged" in caps.attention_mechanisms and "grouped-query" in caps.attention_mechanisms
        assert "float32" in caps.supported_dtypes and "cpu" in caps.supported_devices
        assert caps.dynamic_batching and caps.continuous_batching
        assert not caps.tensor_parallel and not caps.pipeline_parallel
        assert 1 <= caps.optimal_batch_size <= caps.max_batch_size
        assert caps.supports_batch_size(caps.max_batch_size) and not caps.supports_batch_size(caps.max_batch_size + 1)
        assert not caps.supports_batch_size(0)


@pytest.mark.cpu_only
def test_packed_weights_are_counted_once(tiny_llama_dir):
    """Where linears run on oneDNN-packed weights (batch invariance off), the packed copy
    replaces the plain one: the weights in memory are still the checkpoint's bytes, not
    twice them.  The batch-invariant default keeps the plain weights and the panels the
    panel GEMM runs on, and counts both."""
    with running_server(tiny_llama_dir) as invariant, ExecutorClient(invariant.target, timeout=30) as ex:
        caps = ex.capabilities()
        assert caps.batch_invariant
        linears = [m for m in invariant.app.servicer.gate.workers["tiny"].executor.model.modules()
                   if isinstance(m, FastLinear)]
        panels = sum(m.panels.untyped_storage().nbytes() for m in linears)
        assert panels >= sum(m.weight.numel() * 4 for m in linears)  # every float linear packed (zeros pad)
        assert caps.memory.parameter_bytes == checkpoint_bytes(tiny_llama_dir) + panels
    with running_server(tiny_llama_dir, batch_invariant="off") as packed, \
            ExecutorClient(packed.target, timeout=30) as ex:
        caps = ex.capabilities()
        if "onednn-packed" not in caps.kernel_path:
            pytest.skip(f"oneDNN packed linears do not run on this CPU ({caps.kernel_path})")
        linears = [m for m in packed.app.servicer.gate.workers["tiny"].executor.model.modules()
                   if isinstance(m, FastLinear)]
        # "batched" (the load-time timing found packed slower for one row here, as it may on a busy
        # machine): the plain copy is kept beside the packed one by design, and counted
        extra = sum(m.packed.numel() * 4 for m in linears if m.pack == "batched")
        assert caps.memory.parameter_bytes == checkpoint_bytes(tiny_llama_dir) + extra


def test_status_counts_operations_and_memory(tiny_llama_dir):
    with running_server(tiny_llama_dir) as server, ExecutorClient(server.target, timeout=30) as ex:
        before = ex.status()
        assert before.executor_state is ExecutorState.READY
        out = ex.prefill([1, 2, 3, 4, 5, 6, 7], logits=LogitsPolicy.argmax())
        step = ex.decode(1, out.kv_cache, LogitsPolicy.argmax())
        ex.batch_decode([(2, step.kv_cache)], LogitsPolicy.argmax())
        after = ex.status()
        assert after.prefill_operations - before.prefill_operations == 1
        assert after.decode_operations - before.decode_operations == 2
        assert after.avg_prefill_ms > 0 and after.avg_decode_ms > 0
        caps = ex.capabilities()
        block_bytes = caps.memory.kv_bytes_per_token_per_layer * caps.memory.num_layers * caps.kv_block_size
        assert after.memory_allocated_bytes == caps.memory.parameter_bytes + caps.kv_bytes
        assert after.memory_used_bytes == caps.memory.parameter_bytes + after.kv_blocks_used * block_bytes
        assert after.memory_peak_bytes >= after.memory_used_bytes > before.memory_used_bytes
        assert after.memory_utilization == pytest.approx(after.memory_used_bytes / after.memory_allocated_bytes)
        ex.release_cache(out.kv_cache)


def test_executor_state_reports_an_unexpected_failure_until_a_forward_succeeds(tiny_llama_dir, monkeypatch):
    from ferrum_rpc.types import ServerState

    ex = TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=512, block_size=4))
    assert ex.status().executor_state is ExecutorState.READY
    assert ex.status(ServerState.LOADING).executor_state is ExecutorState.INITIALIZING
    assert ex.status(queue_depth=3).executor_state is ExecutorState.BUSY
    assert ex.status(ServerState.DRAINING).executor_state is ExecutorState.SHUTDOWN

    def forward(*args, **kwargs):
        raise RuntimeError("injected device failure")

    monkeypatch.setattr(ex.model, "forward", forward)
    with pytest.raises(RuntimeError):
        ex.prefill([1, 2, 3])
    assert ex.status().executor_state is ExecutorState.ERROR
    monkeypatch.undo()
    ex.release_cache(ex.prefill([1, 2, 3]).kv_cache.cache_id)
    assert ex.status().executor_state is ExecutorState.READY
