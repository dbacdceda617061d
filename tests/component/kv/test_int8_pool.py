"""The int8 KV pool (--kv-dtype int8) on its own: the quantization by blocks of 32 of
each row, what a row's bits depend on (the row alone: never the batch it was written
in, on the eager write and the fused op's), the fused attention's reading of the
blocks' scales (against the rows dequantized, and on each ISA's loops), copy on
write, and the pool's bytes."""

from __future__ import annotations

import math

import pytest
import torch

from ferrum_rpc.server.kernels import fused
from ferrum_rpc.server.kernels.rope import rope_tables
from ferrum_rpc.server.kv.pool import SCALE_DTYPE, KvPool, dequantize_rows, quantize_rows, scale_blocks

CPU = torch.device("cpu")


def test_quantize_round_trip_is_within_half_a_step_of_each_block():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, 64, generator=gen) * torch.logspace(-3, 2, 50).view(50, 1, 1)
    values, scale = quantize_rows(x)
    assert values.dtype == torch.int8 and scale.shape == (50, 3, 2) and scale.dtype == SCALE_DTYPE == torch.float16
    blocks = values.view(50, 3, 2, 32)
    assert (blocks.abs().amax(-1) == 127).all()  # each block's largest value reaches the end of the range
    back = dequantize_rows(values, scale, torch.float32)
    step = scale.float().repeat_interleave(32, -1)  # each value's block's stored scale
    assert ((back - x).abs() <= step / 2 * (1 + 1e-6)).all()
    assert torch.equal(scale, (x.view(50, 3, 2, 32).abs().amax(-1) / 127).half())


def test_a_loud_block_leaves_the_rest_of_its_row_alone():
    """The point of blocks: one outlier (a RoPE'd key's loud dims) coarsens its own 32
    values' steps, not the whole row's; and a head dim that is no multiple of 32 ends
    in a shorter block (the tiny test model's 16: one block, the row)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 80, generator=gen)
    loud = x.clone()
    loud[:, 40] = 500.0  # block 1 of [0, 32), [32, 64), [64, 80)
    (qa, sa), (qb, sb) = quantize_rows(x), quantize_rows(loud)
    assert scale_blocks(80) == 3 and sa.shape == (4, 3) and scale_blocks(16) == 1 and scale_blocks(64) == 2
    assert torch.equal(qa[:, :32], qb[:, :32]) and torch.equal(qa[:, 64:], qb[:, 64:])
    assert torch.equal(sa[:, [0, 2]], sb[:, [0, 2]]) and (sb[:, 1] > 20 * sa[:, 1]).all()
    assert torch.equal(sa[:, 2], (x[:, 64:].abs().amax(-1) / 127).half())  # the short block's own 16 values
    assert (dequantize_rows(qb, sb, torch.float32) - loud).abs()[:, :32].max() < 0.02


def test_quantize_edge_rows():
    x = torch.zeros(4, 8)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] = torch.arange(8) - 3.5
    values, scale = quantize_rows(x)
    assert scale.shape == (4, 1)  # 8 values: one block
    assert scale[0] == 0 and (values[0] == 0).all()  # a zero row: scale 0, reads back 0
    assert dequantize_rows(values[:1], scale[:1], torch.float32).eq(0).all()
    for row in (1, 2):  # non-finite in, non-finite out (never a plausible finite row)
        assert not dequantize_rows(values[row], scale[row], torch.float32).isfinite().all()
    assert values[3].tolist() == [-127, -91, -54, -18, 18, 54, 91, 127]  # half steps round to even


def test_a_rows_bits_do_not_depend_on_the_rows_written_with_it():
    """The same token's k, v written alone and inside a batch of others (eager update):
    identical int8 values and scales."""
    gen = torch.Generator().manual_seed(1)
    L, H, D = 1, 3, 64
    k, v = torch.randn(3, 5, H, D, generator=gen), torch.randn(3, 5, H, D, generator=gen)
    k[1] *= 100  # a loud neighbour row: would move a per-batch scale
    alone, batched = (KvPool(L, 8, 4, H, D, torch.int8, CPU) for _ in range(2))
    alone.batch([[0, 1]], [0], [5]).update(0, k[:1], v[:1])
    batched.batch([[3, 4], [0, 1], [5, 6]], [0, 0, 0], [5, 5, 5]).update(0, k[[1, 0, 2]], v[[1, 0, 2]])
    for a, b in zip(alone.tensors(), batched.tensors()):
        assert torch.equal(a[:, :2], b[:, :2])


@pytest.mark.parametrize("dtype,D", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 48)])
def test_the_fused_write_of_a_row_does_not_depend_on_its_batch(dtype, D):
    ok, why = fused.probe_fused(torch.float32)
    assert ok, why
    gen = torch.Generator().manual_seed(2)
    H, Hkv = 6, 2
    cfg = type("C", (), dict(head_dim=D, rope_theta=10000.0, max_position_embeddings=64))
    cos, sin = rope_tables(cfg, CPU)
    q = torch.randn(3, 4, H, D, generator=gen).to(dtype)
    k = torch.randn(3, 4, Hkv, D, generator=gen).to(dtype)
    v = torch.randn(3, 4, Hkv, D, generator=gen).to(dtype)
    k[2] *= 50
    outs, pools = [], []
    for rows, tables in (([0], [[0, 1]]), ([1, 0, 2], [[2, 3], [0, 1], [4, 5]])):
        pool = KvPool(1, 8, 4, Hkv, D, torch.int8, CPU)
        kv = pool.batch(tables, [0] * len(rows), [4] * len(rows))
        out = torch.ops.ferrum_fused.paged_attention(q[rows], k[rows], v[rows], cos, sin, kv.positions, pool.k[0],
                                                     pool.v[0], kv.write_slots, kv.tables, 1 / math.sqrt(D),
                                                     *pool.scales(0))
        outs.append(out[rows.index(0)])
        pools.append(pool)
    assert torch.equal(outs[0], outs[1])  # the output row's bits too
    for a, b in zip(pools[0].tensors(), pools[1].tensors()):
        assert torch.equal(a[:, :1], b[:, :1])  # block 0 holds the token's rows in both
    # and the fused write quantizes as quantize_rows does, from the rotated float32 key
    assert (pools[0].v_scale[0, 0] == quantize_rows(v[0].float())[1]).all()
    assert torch.equal(pools[0].v[0, 0], quantize_rows(v[0].float())[0])


def test_int8_pool_refuses_missing_scales():
    pool = KvPool(1, 4, 4, 2, 64, torch.int8, CPU)
    kv = pool.batch([[0]], [0], [1])
    cfg = type("C", (), dict(head_dim=64, rope_theta=10000.0, max_position_embeddings=16))
    cos, sin = rope_tables(cfg, CPU)
    x = torch.randn(1, 1, 2, 64)
    with pytest.raises(RuntimeError, match="k_scale and v_scale"):
        torch.ops.ferrum_fused.paged_attention(x, x, x, cos, sin, kv.positions, pool.k[0], pool.v[0],
                                               kv.write_slots, kv.tables, 0.125)
    # a row's scales in the old layout (one a row, float32): refused, not misread
    old = [torch.zeros(pool.k.shape[1:4]) for _ in range(2)]
    with pytest.raises(RuntimeError, match=r"ceil\(head_dim / 32\)"):
        torch.ops.ferrum_fused.paged_attention(x, x, x, cos, sin, kv.positions, pool.k[0], pool.v[0],
                                               kv.write_slots, kv.tables, 0.125, *old)


def test_copy_on_write_copies_the_scales():
    gen = torch.Generator().manual_seed(3)
    pool = KvPool(2, 4, 4, 2, 16, torch.int8, CPU)
    for t in pool.tensors():
        t.copy_(torch.randint(-127, 128, t.shape, generator=gen) if t.dtype == torch.int8 else torch.rand(t.shape))
    pool.copy_blocks([(1, 3)])
    for t in pool.tensors():
        assert torch.equal(t[:, 3], t[:, 1])


def test_int8_pool_bytes():
    """SmolLM2-135M's shape (30 layers, 3 kv heads of 64): int8 with its two float16
    scales a row holds 3.76x the tokens of float32 in the same bytes (1.88x bfloat16's)."""
    f32, bf16, i8 = (KvPool.bytes_per_token(30, 3, 64, d) for d in (torch.float32, torch.bfloat16, torch.int8))
    assert (f32, bf16, i8) == (46080, 23040, 2 * 30 * 3 * (64 + 2 * 2))
    assert f32 / i8 >= 2.5
    pool = KvPool(30, 10, 16, 3, 64, torch.int8, CPU)
    assert pool.nbytes == 11 * 16 * i8  # the scratch block included


@pytest.mark.parametrize("quantize,invariant", [("w4a8", False), ("none", True)])
def test_decode_stack_over_an_int8_pool_equals_its_layer_by_layer_steps(tiny_llama_dir, quantize, invariant):
    """The decode stack's one-region step (quantized linears) and its panel step (the
    batch-invariant float linears) over an int8 pool: the hidden states, the int8 rows
    and the scales they write are the bits of its layer-by-layer steps (layer_step,
    paged_attention with the scales); a stack without the scales refuses the pool."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    config = ExecutorConfig(kv_tokens=64, quantize=quantize, batch_invariant=invariant, kv_dtype="int8")
    model = TorchExecutor.from_path("tiny", tiny_llama_dir, config).model
    stack, cfg = model.layer_ops, model.config
    assert stack.one_region() or stack.panels_region()
    gen = torch.Generator().manual_seed(4)
    pool = KvPool(2, 12, 4, cfg.num_kv_heads, cfg.head_dim, torch.int8, CPU)
    for t in pool.tensors():
        t.copy_(torch.randint(-127, 128, t.shape, generator=gen) if t.dtype == torch.int8 else
                torch.rand(t.shape, generator=gen) / 50)
    for B, T in [(1, 1), (2, 1), (1, 3)]:
        x = torch.randn(B, T, cfg.hidden_size, generator=gen)
        tables = torch.stack([torch.randperm(12, generator=gen)[:3] for _ in range(B)])
        positions = torch.stack([torch.arange(T) + 2 + 3 * b % 7 for b in range(B)])
        slots = (tables.gather(1, positions // 4) * 4 + positions % 4).reshape(-1)
        runs = []
        for regions in (True, False):
            stack.set_regions(regions)
            copy = [t.clone() for t in pool.tensors()]
            stack.set_kv_scales(copy[2], copy[3])
            out = stack.forward(x, model.rope_cos, model.rope_sin, positions, copy[0], copy[1], slots, tables, 0, 2)
            runs.append((out, copy))
        stack.set_regions(True)
        assert torch.equal(runs[0][0], runs[1][0]), (B, T)
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
        assert not all(torch.equal(a, b) for a, b in zip(runs[0][1], pool.tensors()))  # it wrote
    fresh = torch.classes.ferrum_fused.DecodeStack(cfg.num_heads, cfg.num_kv_heads, 1 / cfg.head_dim ** 0.5)
    for args in model._whole_layer_args():
        fresh.add_layer(*args)
    with pytest.raises(RuntimeError, match="set_kv_scales"):
        fresh.forward(x, model.rope_cos, model.rope_sin, positions, pool.k, pool.v, slots, tables, 0, 2)
