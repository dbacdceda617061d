"""What an executor tells about itself: its model (GetModelInfo), what it serves
(GetCapabilities), its live state (GetStatus, through ``stats.py``) and its costs."""

from __future__ import annotations

import torch

from ferrum_rpc.types import (
    LOGITS_DTYPES,
    Capabilities,
    ExecutorStatus,
    LogitsKind,
    MemoryRequirements,
    ModelInfo,
    ServerState,
)
from .transfer import fingerprint
from ..models import TORCH_DTYPES
from .stats import measure_optimal_batch


class Describes:
    """Mixed into :class:`~.executor.TorchExecutor` (reads its model, config, pool,
    block manager, stats and shard)."""

    def memory_requirements(self) -> MemoryRequirements:
        return self.stats.memory_requirements()

    def measure_optimal_batch(self, repeats: int = 3) -> int:
        """The decode crossover (see ``stats.measure_optimal_batch``)."""
        return measure_optimal_batch(self, repeats)

    def status(self, state: ServerState = ServerState.SERVING, queue_depth: int = 0,
               tenant: str = "") -> ExecutorStatus:
        return self.stats.status(state, queue_depth, self.bounds(tenant))

    # -- queries ---------------------------------------------------------------
    def info(self) -> ModelInfo:
        mc = self.model_config
        return ModelInfo(
            name=self.name, architecture=mc.architecture, vocab_size=mc.vocab_size,
            hidden_size=mc.hidden_size, num_layers=mc.num_layers, num_attention_heads=mc.num_heads,
            num_kv_heads=mc.num_kv_heads, head_dim=mc.head_dim, max_sequence_length=self.max_seq_len,
            dtype=self.config.dtype, device=str(self.device),
            parameter_count=getattr(self.model, "parameter_count", 0),
            eos_token_ids=mc.eos_token_ids, bos_token_id=mc.bos_token_id or 0,
            kv_dtype=self.config.kv_dtype_name,
        )

    def capabilities(self) -> Capabilities:
        mc = self.model_config
        return Capabilities(
            model=self.name, max_batch_size=self.config.max_batch_size,
            max_sequence_length=self.max_seq_len, kv_block_size=self.kv.block_size,
            kv_num_blocks=self.kv.num_blocks, kv_capacity_tokens=self.kv.num_blocks * self.kv.block_size,
            logits_kinds=tuple(LogitsKind), logits_dtypes=LOGITS_DTYPES, chunked_prefill=True,
            forward_verify=True, truncate_kv=True, max_message_bytes=self.config.max_message_bytes,
            idle_timeout_s=self.config.idle_timeout_s, prefill_chunk_tokens=self.config.prefill_chunk,
            decode_session=True, prefix_cache=self.config.prefix_caching, fork_cache=True,
            mixture_of_experts=self.model_config.num_experts > 0,
            architecture=self.model_config.architecture, kv_bytes=self.pool.nbytes,
            kernel_path="; ".join([self.model.kernels.describe()] + ([self.graphs.describe()] if self.graphs else [])),
            cpu_capability=self.model.kernels.cpu_capability,
            quantization=self.config.quantize,
            attention_mechanisms=("causal", "rotary", "paged",
                                  "grouped-query" if mc.num_kv_heads < mc.num_heads else "multi-head"),
            supported_dtypes=tuple(d for d in TORCH_DTYPES if d != "float16"),
            supported_devices=("cpu", "cuda") if torch.cuda.is_available() else ("cpu",),
            memory=self.memory_requirements(), optimal_batch_size=self.optimal_batch_size,
            token_choice=True, tensor_parallel=self.shard is not None,
            accepts_imports=self.shard is None, kv_fingerprint=fingerprint(self).digest,
            kv_events=self.kv.prefix_caching, batch_invariant=getattr(self.model, "batch_invariant", False),
            tensor_parallel_degree=self.shard.degree if self.shard else 1,
            tensor_parallel_fallbacks=self._fallbacks(),
            max_adapters=self.adapters.max_adapters if self.adapters else 0,
            max_lora_rank=self.adapters.max_rank if self.adapters else 0,
            weights_version=self.weights.version,
        )

    def _fallbacks(self) -> tuple[str, ...]:
        """What runs instead of the fast paths that cannot run sharded (none unsplit)."""
        if self.shard is None:
            return ()
        return self.shard.fallbacks + (
            "FULL logits: gather whole rows from every rank (ARGMAX/TOP_K reduce top-k only)",
            "token choice: reduced across vocabulary slices; whole rows only beside FULL logits (SpeculativeDecode's "
            "rows included), for top-k above 4096, a nucleus wider than 256 tokens, top-k ties past the candidates "
            "and candidate lists half a vocabulary slice wide (costlier than the row) "
            f"({self.shard.choice_fallback_rows} rows so far)",
            "whole-layer fused decode op: per-op path (each layer ends in all-reduces)",
        )
