"""Rotary position embeddings: the tables computed once per model, and their eager
application (the reference the fused attention kernel is held to)."""

from __future__ import annotations

import torch


def rope_tables(cfg, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for every position, computed once per model: (max_pos, head_dim) float32.
    ``cfg``: anything with ``head_dim``, ``rope_theta`` and ``max_position_embeddings``."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    pos = torch.arange(cfg.max_position_embeddings, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (P, D/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (P, D)
    return emb.cos().to(device), emb.sin().to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, T, H, D); cos/sin: (B, T, 1, D) already in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
