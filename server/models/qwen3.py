"""Qwen3 dense: the Llama block plus RMSNorm on each head's q and k before RoPE."""

from __future__ import annotations

import torch

from .config import ModelConfig
from .layers import Attention, DecoderLayer, RMSNorm
from .llama import LlamaForCausalLM


class Qwen3Attention(Attention):
    has_qk_norm = True

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)  # over D of (B, T, H, D)


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
