"""The executor's statistics: forward counters, memory accounting, the status
report built from them, and the load-time decode benchmark (whose forwards
are not callers' work, so it runs with the counters put back afterwards)."""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING

import torch

from ferrum_rpc.errors import ExecutorError
from ..kv.pool import KvPool
from ferrum_rpc.types import DecodeInput, ExecutorState, ExecutorStatus, LogitsPolicy, MemoryRequirements, ServerState

if TYPE_CHECKING:
    from .executor import TorchExecutor

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

    def __init__(self, ex: TorchExecutor):
        self.ex = ex
        mc = ex.model_config
        self.forwards = 0
        self.tokens_processed = 0
        self.batch_sizes: collections.Counter[int] = collections.Counter()  # forwards by sequences in them
        self.burst_forwards = 0  # decode-ahead forwards run in bursts (engine/burst.py)
        self.started = time.monotonic()
        # Forwards by kind (prompt tokens in them, or decodes only): count and wall time.
        self.op_counts: collections.Counter[str] = collections.Counter()
        self.op_ns: collections.Counter[str] = collections.Counter()
        self.failed = False  # the last forward failed outside the error table
        self.parameter_bytes = resident_weight_bytes(ex.model)
        self.block_bytes = KvPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim,
                                                  ex.kv_dtype) * ex.kv.block_size
        self.memory_peak = self.parameter_bytes
        self.overhead_bytes = max(0, _process_rss_bytes() - self.parameter_bytes - ex.pool.nbytes)

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
        kv = self.ex.kv
        saved = (self.forwards, self.tokens_processed, self.batch_sizes.copy(), self.op_counts.copy(),
                 self.op_ns.copy(), self.memory_peak, kv.queried_tokens, kv.hit_tokens)
        try:
            yield
        finally:
            (self.forwards, self.tokens_processed, self.batch_sizes, self.op_counts, self.op_ns, self.memory_peak,
             kv.queried_tokens, kv.hit_tokens) = saved

    def memory_used(self) -> int:
        used = self.parameter_bytes + self.ex.kv.num_used * self.block_bytes
        self.memory_peak = max(self.memory_peak, used)
        return used

    def memory_requirements(self) -> MemoryRequirements:
        ex, mc = self.ex, self.ex.model_config
        element = torch.tensor([], dtype=ex.dtype).element_size()
        q_kv = (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim
        intermediate = getattr(mc, "intermediate_size", 0) or 0
        return MemoryRequirements(
            parameter_bytes=self.parameter_bytes,
            kv_bytes_per_token_per_layer=KvPool.bytes_per_token(1, mc.num_kv_heads, mc.head_dim, ex.kv_dtype),
            activation_bytes_per_token=(4 * mc.hidden_size + q_kv + 3 * intermediate) * element + mc.vocab_size * 4,
            overhead_bytes=self.overhead_bytes, num_layers=mc.num_layers)

    def status(self, state: ServerState, queue_depth: int, bounds) -> ExecutorStatus:
        """``bounds``: the asking tenant's (config.TenantBounds)."""
        ex, kv = self.ex, self.ex.kv
        used, allocated = self.memory_used(), self.parameter_bytes + ex.pool.nbytes
        return ExecutorStatus(
            state=state, server_instance_id=ex.instance_id, model=ex.name,
            adapters_loaded=len(ex.adapters.by_name) if ex.adapters else 0,
            adapter_bytes=ex.adapters.nbytes if ex.adapters else 0, weights_version=ex.weights.version,
            kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.num_used,
            kv_blocks_free=kv.num_free, active_sequences=len(kv), queue_depth=queue_depth,
            forwards=self.forwards, tokens_processed=self.tokens_processed,
            uptime_s=time.monotonic() - self.started, kv_blocks_shared=kv.num_shared,
            prefix_cache_queried_tokens=kv.queried_tokens, prefix_cache_hit_tokens=kv.hit_tokens,
            prefix_cache_hit_rate=kv.hit_tokens / kv.queried_tokens if kv.queried_tokens else 0.0,
            sequences_expired=kv.expired_count, kv_blocks_cached=kv.num_cached_free,
            executor_state=self._executor_state(state, queue_depth),
            prefill_operations=self.op_counts["prefill"], decode_operations=self.op_counts["decode"],
            avg_prefill_ms=self._avg_ms("prefill"), avg_decode_ms=self._avg_ms("decode"),
            memory_allocated_bytes=allocated, memory_used_bytes=used, memory_peak_bytes=self.memory_peak,
            memory_utilization=used / allocated,
            tenant_max_sequences=bounds.max_sequences, tenant_kv_tokens=bounds.kv_tokens,
            tenant_ahead_sequences=bounds.ahead_sequences,
        )

    def _avg_ms(self, kind: str) -> float:
        return self.op_ns[kind] / self.op_counts[kind] / 1e6 if self.op_counts[kind] else 0.0

    def _executor_state(self, state: ServerState, queue_depth: int) -> ExecutorState:
        if state is ServerState.LOADING:
            return ExecutorState.INITIALIZING
        if state is ServerState.DRAINING:
            return ExecutorState.SHUTDOWN
        if self.failed:
            return ExecutorState.ERROR
        return ExecutorState.BUSY if queue_depth else ExecutorState.READY


def measure_optimal_batch(ex: TorchExecutor, repeats: int = 3) -> int:
    """The decode crossover: times one decode step at batch 1, 2, 4, ... (as far as
    the batch limit and the pool allow) and returns the batch past which doubling
    raises throughput by less than 10%.  Uses (and releases) sequences of its own;
    the statistics do not count its forwards."""
    sizes, block = [1], ex.kv.block_size
    room = ex.kv.num_free // -(-(block + repeats * 7) // block)  # blocks one sequence may reach
    limit = min(ex.config.max_batch_size, room, 64, ex.config.max_sequences or 64,
                ex.bounds("").max_sequences or 64)
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    handles, best, step_s = [], sizes[0], {}
    with ex.stats.not_counted():
        try:
            for _ in range(sizes[-1]):
                handles.append(ex.prefill([0] * block, None, LogitsPolicy.argmax()).kv_cache)
            for size in sizes:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    outs = ex.batch_decode([DecodeInput(0, h) for h in handles[:size]], LogitsPolicy.argmax())
                    times.append(time.perf_counter() - t0)
                    handles[:size] = [o.kv_cache for o in outs]
                step_s[size] = sorted(times)[len(times) // 2]
                if size > 1 and (size / step_s[size]) < 1.1 * (size // 2 / step_s[size // 2]):
                    break
                best = size
        except ExecutorError as exc:  # a pool or caps too small to measure: say so, serve anyway
            log.warning("%s: decode crossover not measured: %s", ex.name, exc)
            return 0
        finally:
            for h in handles:
                ex.release_cache(h.cache_id)
    ex.optimal_batch_size = best
    log.info("%s: decode crossover at batch %d (step ms by batch: %s)", ex.name, best,
             ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in step_s.items()))
    return best
