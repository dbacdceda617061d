"""The executor's statistics: forward counters, memory accounting, the status
report built from them, and the load-time decode benchmark (whose forwards
are not callers' work, so it runs with the counters put back afterwards)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time

import torch

from ..kv.blocks import BlockManager
from ..kv.pool import KvPool
from ferrum_rpc.types import ExecutorState, MemoryRequirements, ServerState


log = logging.getLogger(__name__)


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as they sit in memory: every parameter and buffer, and the
    packed copies packed linears run on, each storage counted once."""
    seen: dict[int, int] = {}
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        for extra in ("packed", "panels"):  # oneDNN's packed copy, panel_gemm.cpp's
            if isinstance(packed := getattr(module, extra, None), torch.Tensor):
                tensors.append(packed)
        for t in tensors:
            if t.layout != torch.strided or t.is_mkldnn:  # opaque (oneDNN-packed): no storage to share
                seen[id(t)] = t.numel() * t.element_size()
            else:
                seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _process_rss_bytes() -> int:
    """This process's resident memory (Linux), or 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Stats:
    """One executor's counters and memory figures (the worker thread writes them;
    a metrics scrape only reads them)."""

    def __init__(self, model, model_config, kv: BlockManager, pool: KvPool, dtype: torch.dtype,
                 kv_dtype: torch.dtype):
        self.model_config, self.kv, self.pool, self.dtype, self.kv_dtype = model_config, kv, pool, dtype, kv_dtype
        mc = model_config
        self.forwards = 0
        self.tokens_processed = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # forwards by sequences in them
        self.burst_forwards = 0  # decode-ahead forwards run in bursts (engine/burst.py)
        self.started = time.monotonic()
        # Forwards by kind (prompt tokens in them, or decodes only): count and wall time.
        self.op_counts: collections.Counter[str] = collections.Counter()
        self.op_ns: collections.Counter[str] = collections.Counter()
        self.failed = False  # the last forward failed outside the error table
        self.parameter_bytes = resident_weight_bytes(model)
        self.block_bytes = KvPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                  kv_dtype) * kv.block_size
        self.memory_peak = self.parameter_bytes
        self.overhead_bytes = max(0, _process_rss_bytes() - self.parameter_bytes - pool.nbytes)

    def count_forward(self, decodes_only: bool, ns: int, sequences: int, tokens: int) -> None:
        kind = "decode" if decodes_only else "prefill"
        self.op_counts[kind] += 1
        self.op_ns[kind] += ns
        self.memory_used()
        self.forwards += 1
        self.tokens_processed += tokens
        self.batch_sizes[sequences] += 1

    @contextlib.contextmanager
    def not_counted(self):
        """Work that is not callers' (the load-time benchmark): the statistics, prefix-cache
        counters included, are as they were before it."""
        kv = self.kv
        saved = (self.forwards, self.tokens_processed, self.batch_sizes.copy(), self.op_counts.copy(),
                 self.op_ns.copy(), self.memory_peak, kv.queried_tokens, kv.hit_tokens)
        try:
            yield
        finally:
            (self.forwards, self.tokens_processed, self.batch_sizes, self.op_counts, self.op_ns, self.memory_peak,
             kv.queried_tokens, kv.hit_tokens) = saved

    def memory_used(self) -> int:
        used = self.parameter_bytes + self.kv.num_used * self.block_bytes
        self.memory_peak = max(self.memory_peak, used)
        return used

    def memory_requirements(self) -> MemoryRequirements:
        mc = self.model_config
        element = torch.tensor([], dtype=self.dtype).element_size()
        q_kv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        intermediate = getattr(mc, "intermediate_size", 0) or 0
        return MemoryRequirements(
            parameter_bytes=self.parameter_bytes,
            kv_bytes_per_token_per_layer=KvPool.bytes_per_token(1, mc.num_kv_heads, mc.head_dim, self.kv_dtype),
            activation_bytes_per_token=(4 * mc.hidden_size + q_kv + 3 * intermediate) * element + mc.vocab_size * 4,
            overhead_bytes=self.overhead_bytes, num_layers=mc.num_layers)

    def avg_ms(self, kind: str) -> float:
        return self.op_ns[kind] / self.op_counts[kind] / 1e6 if self.op_counts[kind] else 0.0

    def executor_state(self, state: ServerState, queue_depth: int) -> ExecutorState:
        if state is ServerState.LOADING:
            return ExecutorState.INITIALIZING
        if state is ServerState.DRAINING:
            return ExecutorState.SHUTDOWN
        if self.failed:
            return ExecutorState.ERROR
        return ExecutorState.BUSY if queue_depth else ExecutorState.READY
