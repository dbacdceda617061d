"""The fused step ops (``csrc/fused.h`` lists their files): probing, and the choice per model.

A batch-1 decode step of the 30-layer default model ran ~1,200 small eager
ops; RMSNorm (~8 ops), the MLP's silu*up (~4) and RoPE + KV write + paged
attention (~25 per layer) become one op each.  They are built with the int8/int4
kernels (one library, compiled once and cached, see ``build.py``) and taken only
where a real call agrees with the eager torch ops on this CPU (``probe_fused``);
the eager ops stay the fallback (``--step-ops eager``) and run every forward of
more than ``FUSED_MAX_TOKENS`` tokens per sequence (prompt chunks), where
per-op cost is amortised and torch's flash attention is faster.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .build import load_library
from .probe import TOLERANCE, Verdict, as_probe, built, check, relative_error, within
from .rope import apply_rope, rope_tables
from ..config import STEP_OPS
from ..kv.pool import KvPool, dequantize_rows, quantize_query

AUTO, FUSED, EAGER = STEP_OPS


def choose_step_ops(requested: str, dtype: torch.dtype, device: torch.device) -> tuple[bool, str]:
    """Whether a model runs the fused ops, and why.

    Raises:
        ValueError: ``requested`` is "fused" and they cannot run here.
    """
    if requested not in STEP_OPS:
        raise ValueError(f"step ops must be one of {STEP_OPS}, not {requested!r}")
    if requested == EAGER:
        return False, "eager (forced by configuration)"
    ok, why = (False, f"fused ops are CPU code; device is {device.type}") if device.type != "cpu" \
        else probe_fused(dtype)
    if ok:
        return True, f"fused ({why})"
    if requested == FUSED:
        raise ValueError(f"step ops {FUSED!r} cannot run here: {why}")
    return False, f"eager (fallback: {why})"


def eager_attention(q, k, v, cos_table, sin_table, positions, pool: KvPool, layer: int, kv) -> torch.Tensor:
    """The eager ops the fused attention replaces (models/layers.py): the reference."""
    B, T, H, D = q.shape
    cos = cos_table[positions].unsqueeze(2).to(q.dtype)
    sin = sin_table[positions].unsqueeze(2).to(q.dtype)
    keys, values = kv.update(layer, apply_rope(k, cos, sin), v)
    q = apply_rope(q, cos, sin)
    if pool.quantized:  # an int8 pool's scores take the query quantized
        q = quantize_query(q)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=kv.mask, enable_gqa=True)
    return out.transpose(1, 2).reshape(B, T, H * D)


@as_probe()
def probe_fused(dtype: torch.dtype) -> Verdict:
    """Whether the fused ops build, load and agree with the eager ops here for ``dtype``.
    Returns (ok, reason); never raises."""
    load_library()
    ops, gen, tol = torch.ops.ferrum_fused, torch.Generator().manual_seed(0), TOLERANCE[dtype]
    x = torch.randn(3, 96, generator=gen).to(dtype)
    w = (torch.rand(96, generator=gen) + 0.5).to(dtype)
    want = F.rms_norm(x.float(), (96,), eps=1e-5).to(dtype) * w
    check(ops.rms_norm(x, w, 1e-5), want, tol, "rms_norm disagrees with torch")
    gu = torch.randn(3, 2 * 80, generator=gen).to(dtype)
    gate, up = gu.chunk(2, dim=-1)
    check(ops.silu_mul(gu), F.silu(gate) * up, tol, "silu_mul disagrees with torch")
    within(attention_error(dtype, gen), tol, "paged_attention disagrees with torch")
    if dtype == torch.float32:  # the pool may hold bfloat16 under float32 activations (--kv-dtype)
        within(attention_error(dtype, gen, kv_dtype=torch.bfloat16), tol,
               "paged_attention over a bfloat16 pool disagrees with torch")
    w = torch.randn(70, 80, generator=gen).to(dtype)
    for rows in (1, 3):
        xr = torch.randn(rows, 80, generator=gen).to(dtype)
        check(ops.linear_rows(xr, w), F.linear(xr, w), tol, "linear_rows disagrees with torch")
        check(ops.panel_linear(xr, ops.pack_panels(w), 70), F.linear(xr, w), tol,
              "panel_linear disagrees with torch")
    return True, built(torch.ops.ferrum_woq.isa())


def attention_error(dtype: torch.dtype, gen: torch.Generator, heads: int = 4, kv_heads: int = 2, dim: int = 16,
                    block: int = 4, kv_dtype: torch.dtype | None = None) -> float:
    """Relative error of the fused paged attention against the eager ops, on a
    ragged batch (a 3-token continuation of 5 tokens, a 1-token decode of 9) in
    shuffled, shared-nothing pool blocks (of ``kv_dtype``, else ``dtype``; an int8
    pool's values and scales random), both pools checked after the write (an int8
    pool's as they read back)."""
    cfg = SimpleNamespace(head_dim=dim, rope_theta=10000.0, max_position_embeddings=64)
    cos_table, sin_table = rope_tables(cfg, torch.device("cpu"))
    pools = [KvPool(1, 8, block, kv_heads, dim, kv_dtype or dtype, torch.device("cpu")) for _ in range(2)]
    for pool in pools[1:]:
        if pools[0].quantized:  # random int8 rows and scales
            for src, dst in zip(pools[0].tensors(), pool.tensors()):
                if src.dtype == torch.int8:
                    src.random_(-127, 128, generator=gen)
                else:
                    src.uniform_(0.005, 0.02, generator=gen)
                dst.copy_(src)
            continue
        pool.k.copy_(pools[0].k.normal_(generator=gen))
        pool.v.copy_(pools[0].v.normal_(generator=gen))
    tables, starts, counts = [[5, 2], [0, 7, 3]], [5, 9], [3, 1]
    q = torch.randn(2, 3, heads, dim, generator=gen).to(dtype)
    k = torch.randn(2, 3, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(2, 3, kv_heads, dim, generator=gen).to(dtype)
    kv_eager, kv_fused = (pool.batch(tables, starts, counts) for pool in pools)
    want = eager_attention(q, k, v, cos_table, sin_table, kv_eager.positions, pools[0], 0, kv_eager)
    got = torch.ops.ferrum_fused.paged_attention(q, k, v, cos_table, sin_table, kv_fused.positions, pools[1].k[0],
                                                 pools[1].v[0], kv_fused.write_slots, kv_fused.tables,
                                                 1 / math.sqrt(dim), *pools[1].scales(0))
    real = torch.tensor([[True, True, True], [True, False, False]])  # padded rows' outputs are ignored
    blocks = slice(0, 8)  # not the scratch block: padded tokens all write one slot there, in any order

    def stored(pool, which):  # a pool's K or V as it reads back (an int8 one's dequantized)
        values = getattr(pool, which)[:, blocks]
        if not pool.quantized:
            return values
        return dequantize_rows(values, getattr(pool, f"{which}_scale")[:, blocks], torch.float32)

    return max(relative_error(got[real], want[real]),
               relative_error(stored(pools[1], "k"), stored(pools[0], "k")),
               relative_error(stored(pools[1], "v"), stored(pools[0], "v")))
