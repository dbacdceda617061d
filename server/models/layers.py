"""The decoder's layers (Llama family): rotary embedding, RMSNorm, attention over the
paged KV pool, the gated MLP, and the layer that chains them.

Parameter names mirror Hugging Face's so checkpoints load as they are.  Attention
does not own its cache: each forward receives a ``KvBatch`` that writes the new
keys/values into the paged pool and returns the whole context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels.rope import apply_rope
from ..kv.pool import quantize_query
from .config import ModelConfig
from .linear import fuse_linears


@dataclass
class Rope:
    """One forward's rotary embedding: per-token cos/sin for the eager path, or,
    when ``fused``, the model's whole tables (the fused op gathers by position)."""

    cos: torch.Tensor | None  # (B, T, 1, D) in the activations' dtype; None when fused
    sin: torch.Tensor | None
    table_cos: torch.Tensor  # (max_pos, D) float32
    table_sin: torch.Tensor
    fused: bool


class RMSNorm(nn.Module):
    fused = False  # set by LlamaForCausalLM.use_fused_ops

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return torch.ops.ferrum_fused.rms_norm(x, self.weight, self.eps)
        if x.dtype == torch.float32:  # one fused op, same arithmetic as the reference
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # Normalise in float32 as the reference does, then cast back.
        h = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * h.to(x.dtype)


class Attention(nn.Module):
    has_qk_norm = False
    gather_heads = None  # tensor parallel: (B, H/N, T, S) weights of this rank's heads -> all heads (parallel/shard.py)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.attention_bias)

        self.qkv_proj: nn.Module | None = None

    def qk_norm(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k  # Qwen3 normalises here

    def fuse(self) -> None:
        """Replaces q/k/v projections by one (call after loading weights)."""
        self.qkv_proj = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        del self.q_proj, self.k_proj, self.v_proj

    def projections(self, x: torch.Tensor, lora=None) -> tuple[torch.Tensor, ...]:
        """x (..., C) -> (qkv,) when the projections are fused, else (q, k, v);
        ``lora`` (a ``lora.LayerDeltas`` or ``KernelDeltas``): the adapters' deltas added to them."""
        if self.qkv_proj is None:
            proj = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            names = ("q_proj", "k_proj", "v_proj")
        else:
            proj, names = (self.qkv_proj(x),), ("qkv_proj",)
        if lora is not None:
            for name, y in zip(names, proj):
                lora.add(name, x, y)
        return proj

    def output(self, x: torch.Tensor, lora) -> torch.Tensor:
        y = self.o_proj(x)
        return y if lora is None else lora.add("o_proj", x, y)

    def forward(self, x: torch.Tensor, rope: Rope | list[Rope], kv, lora=None) -> torch.Tensor:
        if getattr(kv, "ragged", False):  # a RaggedBatch: projections over every token at once, attention per group
            proj = self.projections(x, lora)  # (1, N, ...) each
            outs = []
            for (group, batch, width, row), group_rope in zip(kv.groups, rope):
                part = tuple(p[:, row:row + batch * width].view(batch, width, -1) for p in proj)
                outs.append(self.attend(part, group_rope, group).view(1, batch * width, -1))
            return self.output(torch.cat(outs, dim=1) if len(outs) > 1 else outs[0], lora)
        return self.output(self.attend(self.projections(x, lora), rope, kv), lora)

    def attend(self, proj: tuple[torch.Tensor, ...], rope: Rope, kv) -> torch.Tensor:
        """Projections (B, T, ...) -> attention output (B, T, H*D), writing k, v to the pool."""
        B, T = proj[0].shape[:2]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        if len(proj) == 1:
            q, k, v = proj[0].split([H * D, Hkv * D, Hkv * D], dim=-1)
        else:
            q, k, v = proj
        if rope.fused:  # RoPE, the pool write and paged attention in one op
            q, k = self.qk_norm(q.reshape(B, T, H, D), k.reshape(B, T, Hkv, D))
            return torch.ops.ferrum_fused.paged_attention(
                q, k, v.reshape(B, T, Hkv, D), rope.table_cos, rope.table_sin, kv.positions, kv.pool.k[self.layer],
                kv.pool.v[self.layer], kv.write_slots, kv.tables, 1 / math.sqrt(D),
                *kv.pool.scales(self.layer))  # an int8 pool's scales, else (None, None)
        cos_sin = (rope.cos, rope.sin)
        if len(proj) == 1 and not self.has_qk_norm:
            # Rotate q and k as one tensor: half the per-layer RoPE ops.
            qkv = proj[0].view(B, T, H + 2 * Hkv, D)  # (B, T, H+2Hkv, D)
            qk = apply_rope(qkv[:, :, :H + Hkv], *cos_sin)
            q, k, v = qk[:, :, :H], qk[:, :, H:], qkv[:, :, H + Hkv:]
        else:
            q = q.reshape(B, T, H, D)  # (B, T, H, D)
            k = k.reshape(B, T, Hkv, D)  # (B, T, Hkv, D)
            v = v.reshape(B, T, Hkv, D)
            q, k = self.qk_norm(q, k)
            q, k = apply_rope(q, *cos_sin), apply_rope(k, *cos_sin)
        keys, values = kv.update(self.layer, k, v)  # (B, Hkv, S, D) each
        if getattr(getattr(kv, "pool", None), "quantized", False):  # an int8 pool's scores take the query
            # quantized, as the fused op's do
            q = quantize_query(q)
        if kv.attention is not None and self.layer in kv.attention:  # analysis: the weights, explicitly
            return self.attend_with_weights(q, keys, values, kv)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=kv.mask, enable_gqa=True
        )  # (B, H, T, D)
        return out.transpose(1, 2).reshape(B, T, -1)


    def attend_with_weights(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kv) -> torch.Tensor:
        """Eager attention that keeps its softmax weights (B, H, T, S) in
        ``kv.attention`` (float32, as transformers' eager attention computes them)."""
        B, T, H, D = q.shape
        groups = H // self.num_kv_heads
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)  # (B, H, S, D)
        scores = q.transpose(1, 2).float() @ keys.float().transpose(-1, -2) / math.sqrt(D)  # (B, H, T, S)
        weights = scores.masked_fill(~kv.mask, float("-inf")).softmax(dim=-1)
        kv.attention[self.layer] = weights if self.gather_heads is None else self.gather_heads(weights)
        out = weights.to(values.dtype) @ values  # (B, H, T, D)
        return out.transpose(1, 2).reshape(B, T, -1)


class MLP(nn.Module):
    fused = False  # set by LlamaForCausalLM.use_fused_ops
    invariant = False  # set by LlamaForCausalLM.make_batch_invariant: one activation arithmetic at any row count

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.gate_up_proj: nn.Module | None = None

    def fuse(self) -> None:
        """Replaces gate/up projections by one (call after loading weights)."""
        self.gate_up_proj = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """``lora`` (a ``lora.LayerDeltas`` or ``KernelDeltas``): the adapters' deltas added to each projection."""
        if lora is not None:
            return self.with_deltas(x, lora)
        if self.gate_up_proj is None:
            gate, up = self.gate_proj(x), self.up_proj(x)
        elif self.invariant:
            return self.down_proj(torch.ops.ferrum_fused.silu_mul_rows(self.gate_up_proj(x)))
        elif self.fused:
            return self.down_proj(torch.ops.ferrum_fused.silu_mul(self.gate_up_proj(x)))
        else:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)

    def with_deltas(self, x: torch.Tensor, lora) -> torch.Tensor:
        if self.gate_up_proj is None:
            h = F.silu(lora.add("gate_proj", x, self.gate_proj(x))) * lora.add("up_proj", x, self.up_proj(x))
        else:
            gate_up = lora.add("gate_up_proj", x, self.gate_up_proj(x))
            if self.invariant:
                h = torch.ops.ferrum_fused.silu_mul_rows(gate_up)
            elif self.fused:
                h = torch.ops.ferrum_fused.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = F.silu(gate) * up
        return lora.add("down_proj", h, self.down_proj(h))


class DecoderLayer(nn.Module):
    attention_cls = Attention

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = self.attention_cls(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rope, kv, lora=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, kv, lora)
        return x + self.mlp(self.post_attention_layernorm(x), lora)
