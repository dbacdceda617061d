"""Qwen3-MoE: Qwen3 attention with a top-k routed mixture of experts as the MLP.

Experts are evaluated batched: routed (token, expert) pairs are sorted by
expert and each expert runs once over all of its tokens, so the Python loop
is over experts that received tokens, never over tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .layers import MLP
from .llama import LlamaForCausalLM
from .qwen3 import Qwen3DecoderLayer


class Experts(nn.Module):
    """Stacked expert weights: gate/up (E, I, C), down (E, C, I)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, I, C = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.gate_proj = nn.Parameter(torch.empty(E, I, C))
        self.up_proj = nn.Parameter(torch.empty(E, I, C))
        self.down_proj = nn.Parameter(torch.empty(E, C, I))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (N, C) -> weights (N, k) in x's dtype and expert ids (N, k)."""
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (N, E)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``lora`` is unused: adapters on expert layers are refused when read (models/lora.py)."""
        B, T, C = x.shape
        flat = x.reshape(-1, C)  # (N, C)
        weights, experts = self.route(flat)
        pair_expert = experts.reshape(-1)  # (N*k,) one entry per routed (token, slot)
        order = pair_expert.argsort(stable=True)  # pairs grouped by expert
        counts = torch.bincount(pair_expert, minlength=self.experts.gate_proj.shape[0]).tolist()
        tokens = order // self.top_k  # token of each grouped pair
        pair_weight = weights.reshape(-1)[order].unsqueeze(-1)  # (N*k, 1)
        out = torch.zeros_like(flat)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            h = flat[rows]  # (n, C)
            h = F.silu(h @ self.experts.gate_proj[e].T) * (h @ self.experts.up_proj[e].T)  # (n, I)
            out.index_add_(0, rows, (h @ self.experts.down_proj[e].T) * pair_weight[start:start + n])
            start += n
        return out.view(B, T, C)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__(cfg, layer)
        if cfg.is_moe_layer(layer):
            self.mlp = SparseMoeBlock(cfg)
        else:
            self.mlp = MLP(cfg)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer


def fuse_expert_weights(state: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    """Stacks per-expert checkpoint tensors (the hub layout) into (E, ...) tensors, in place.

    Accepts ``mlp.experts.{e}.{gate,up,down}_proj.weight`` and transformers'
    fused ``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj`` layouts.
    """
    for layer in range(cfg.num_layers):
        if not cfg.is_moe_layer(layer):
            continue
        prefix = f"model.layers.{layer}.mlp.experts."
        if prefix + "gate_up_proj" in state:
            gate, up = state.pop(prefix + "gate_up_proj").chunk(2, dim=1)
            state[prefix + "gate_proj"], state[prefix + "up_proj"] = gate.contiguous(), up.contiguous()
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            parts = [state.pop(f"{prefix}{e}.{name}.weight") for e in range(cfg.num_experts)]
            state[prefix + name] = torch.stack(parts)
