"""What an executor tells about itself: its model (GetModelInfo), what it serves
(GetCapabilities) and its live state (GetStatus, with the counters of ``stats.py``),
read from the executor."""

from __future__ import annotations

import time

import torch

from ferrum_rpc.types import (
    ExecutorStatus,
    ServerState,
    LOGITS_DTYPES,
    Capabilities,
    LogitsKind,
    ModelInfo,
)
from .transfer import fingerprint
from ..models import TORCH_DTYPES


def info(ex) -> ModelInfo:
    """GetModelInfo: the model's shape as the executor serves it."""
    mc = ex.model_config
    return ModelInfo(
        name=ex.name, architecture=mc.architecture, vocab_size=mc.vocab_size,
        hidden_size=mc.hidden_size, num_layers=mc.num_layers, num_attention_heads=mc.num_heads,
        num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, max_sequence_length=ex.max_seq_len,
        dtype=ex.config.dtype, device=str(ex.device),
        parameter_count=getattr(ex.model, "parameter_count", 0),
        eos_token_ids=mc.eos_token_ids, bos_token_id=mc.bos_token_id or 0,
        kv_dtype=ex.config.kv_dtype_name,
    )



def capabilities(ex) -> Capabilities:
    """GetCapabilities: limits and features, as Ferrum's trait names them."""
    mc = ex.model_config
    return Capabilities(
        model=ex.name, max_batch_size=ex.config.max_batch_size,
        max_sequence_length=ex.max_seq_len, kv_block_size=ex.kv.block_size,
        kv_num_blocks=ex.kv.num_blocks, kv_capacity_tokens=ex.kv.num_blocks * ex.kv.block_size,
        logits_kinds=tuple(LogitsKind), logits_dtypes=LOGITS_DTYPES, chunked_prefill=True,
        forward_verify=True, truncate_kv=True, max_message_bytes=ex.config.max_message_bytes,
        idle_timeout_s=ex.config.idle_timeout_s, prefill_chunk_tokens=ex.config.prefill_chunk,
        decode_session=True, prefix_cache=ex.config.prefix_caching, fork_cache=True,
        mixture_of_experts=ex.model_config.num_experts > 0,
        architecture=ex.model_config.architecture, kv_bytes=ex.pool.nbytes,
        kernel_path="; ".join([ex.model.kernels.describe()] + ([ex.graphs.describe()] if ex.graphs else [])),
        cpu_capability=ex.model.kernels.cpu_capability,
        quantization=ex.config.quantize,
        attention_mechanisms=("causal", "rotary", "paged",
                              "grouped-query" if mc.num_kv_heads < mc.num_heads else "multi-head"),
        supported_dtypes=tuple(d for d in TORCH_DTYPES if d != "float16"),
        supported_devices=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",),
        memory=ex.stats.memory_requirements(), optimal_batch_size=ex.optimal_batch_size,
        token_choice=True, tensor_parallel=ex.shard is not None,
        accepts_imports=ex.shard is None, kv_fingerprint=fingerprint(ex).digest, kv_dtype=ex.config.kv_dtype_name,
        kv_events=ex.kv.prefix_caching, batch_invariant=getattr(ex.model, "batch_invariant", False),
        tensor_parallel_degree=ex.shard.degree if ex.shard else 1,
        tensor_parallel_fallbacks=_fallbacks(ex),
        max_adapters=ex.adapters.max_adapters if ex.adapters else 0,
        max_lora_rank=ex.adapters.max_rank if ex.adapters else 0,
        weights_version=ex.weights.version,
    )



def _fallbacks(ex) -> tuple[str, ...]:
    """What runs instead of the fast paths that cannot run sharded (none unsplit)."""
    if ex.shard is None:
        return ()
    return ex.shard.fallbacks + (
        "FULL logits: gather whole rows from every rank (ARGMAX/TOP_K reduce top-k only)",
        "token choice: reduced across vocabulary slices; whole rows only beside FULL logits (SpeculativeDecode's "
        "rows included), for top-k above 4096, a nucleus wider than 256 tokens, top-k ties past the candidates "
        "and candidate lists half a vocabulary slice wide (costlier than the row) "
        f"({ex.shard.choice_fallback_rows} rows so far)",
        "whole-layer fused decode op: per-op path (each layer ends in all-reduces)",
    )


def status(ex, state: ServerState, queue_depth: int, bounds) -> ExecutorStatus:
    """GetStatus: the executor's live state, for a tenant of ``bounds`` (config.TenantBounds)."""
    stats, kv = ex.stats, ex.kv
    used, allocated = stats.memory_used(), stats.parameter_bytes + ex.pool.nbytes
    return ExecutorStatus(
        state=state, server_instance_id=ex.instance_id, model=ex.name,
        adapters_loaded=len(ex.adapters.by_name) if ex.adapters else 0,
        adapter_bytes=ex.adapters.nbytes if ex.adapters else 0, weights_version=ex.weights.version,
        kv_blocks_total=kv.num_blocks, kv_blocks_used=kv.num_used,
        kv_blocks_free=kv.num_free, active_sequences=len(kv), queue_depth=queue_depth,
        forwards=stats.forwards, tokens_processed=stats.tokens_processed,
        uptime_s=time.monotonic() - stats.started, kv_blocks_shared=kv.num_shared,
        prefix_cache_queried_tokens=kv.queried_tokens, prefix_cache_hit_tokens=kv.hit_tokens,
        prefix_cache_hit_rate=kv.hit_tokens / kv.queried_tokens if kv.queried_tokens else 0.0,
        sequences_expired=kv.expired_count, kv_blocks_cached=kv.num_cached_free,
        executor_state=stats.executor_state(state, queue_depth),
        prefill_operations=stats.op_counts["prefill"], decode_operations=stats.op_counts["decode"],
        avg_prefill_ms=stats.avg_ms("prefill"), avg_decode_ms=stats.avg_ms("decode"),
        memory_allocated_bytes=allocated, memory_used_bytes=used, memory_peak_bytes=stats.memory_peak,
        memory_utilization=used / allocated,
        tenant_max_sequences=bounds.max_sequences, tenant_kv_tokens=bounds.kv_tokens,
        tenant_ahead_sequences=bounds.ahead_sequences,
    )

