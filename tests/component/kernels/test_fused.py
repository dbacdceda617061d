"""The fused step ops (csrc/fused.h lists their files) against the eager torch
ops they replace, on every inner-loop build this CPU can run, in float32 and
bfloat16; and the choice between them.  Whole-model parity with transformers on both step paths
is in tests/system/test_parity.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrum_rpc.server.kernels import build
from ferrum_rpc.server.kernels import fused
from ferrum_rpc.server.kernels.fused import attention_error, choose_step_ops

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def ops():
    ok, why = fused.probe_fused(torch.float32)
    assert ok, f"the fused ops should build and agree on this machine: {why}"
    return torch.ops.ferrum_fused


def rel(got, want) -> float:
    return (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_silu_mul_match_torch(ops, isa, dtype):
    gen = torch.Generator().manual_seed(1)
    for rows, width in [(1, 576), (7, 64), (130, 96)]:  # 130 rows: several threads
        x = (3 * torch.randn(rows, width, generator=gen)).to(dtype)
        w = (torch.rand(width, generator=gen) + 0.5).to(dtype)
        if dtype == torch.float32:
            want = F.rms_norm(x, (width,), w, 1e-5)
        else:
            want = w * F.rms_norm(x.float(), (width,), eps=1e-5).to(dtype)
        assert rel(ops.rms_norm(x, w, 1e-5), want) <= TOL[dtype]
        gu = (3 * torch.randn(rows, 2, width, generator=gen)).to(dtype).view(rows, 2 * width)
        gate, up = gu.chunk(2, dim=-1)
        assert rel(ops.silu_mul(gu), F.silu(gate) * up) <= TOL[dtype]
    # the vector exp at the ends of float32's range (under- and overflow) and between
    gate = torch.tensor([-1e4, -100, -88.5, -87.5, -87, -20, -1e-3, 0, 1e-3, 20, 87, 88.5, 100, 1e4, 3, -3])
    gu = torch.cat([gate, torch.ones(16)]).to(dtype)[None]
    got, want = ops.silu_mul(gu).float(), F.silu(gate.to(dtype)).float()
    assert torch.allclose(got, want, rtol=TOL[dtype], atol=1e-30), (got, want)


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                            (torch.float32, torch.bfloat16), (torch.float32, torch.int8),
                                            (torch.bfloat16, torch.int8)])
@pytest.mark.parametrize("shape", [dict(), dict(heads=9, kv_heads=3, dim=64, block=16), dict(heads=4, kv_heads=4)])
def test_paged_attention_matches_rope_write_and_sdpa(ops, isa, dtype, kv_dtype, shape):
    """Ragged batch, shuffled blocks, grouped-query and plain multi-head shapes, a
    pool in the activations' dtype or bfloat16 under float32 ones, or int8 with its
    scales; the output rows and every pool block written must agree (keys and values
    rounded to the pool's dtype once, as the eager path's write rounds them; an int8
    pool's compared as they read back)."""
    gen = torch.Generator().manual_seed(2)
    assert attention_error(dtype, gen, kv_dtype=kv_dtype, **shape) <= TOL[dtype]


def test_linear_rows_matches_f_linear_in_float64(ops, isa):
    """1-4 rows (a 3-D batch, a strided view), widths with and without remainders
    of the 32- and 8-wide loops, sizes split over threads; each output is one
    thread's dot product in a fixed order: the same bits alone or beside other
    rows, on one thread or two."""
    gen = torch.Generator().manual_seed(3)
    for n, k in [(70, 80), (576, 576), (130, 37), (1000, 64), (3, 8)]:
        w = torch.randn(n, k, generator=gen)
        for rows in range(1, 5):
            x = torch.randn(rows, k, generator=gen)
            got = ops.linear_rows(x, w)
            want = F.linear(x.double(), w.double())
            scale = (x.double().abs() @ w.double().abs().T).max().item()  # the sum of |products|
            assert got.dtype == torch.float32 and got.shape == (rows, n)
            assert (got.double() - want).abs().max().item() <= 4e-7 * scale * k ** 0.5
            assert torch.equal(ops.linear_rows(x[:1], w)[0], got[0])  # row 0 alone: same bits
    x3 = torch.randn(2, 2, 80, generator=gen)
    w = torch.randn(70, 80, generator=gen)
    assert ops.linear_rows(x3, w).shape == (2, 2, 70)
    strided = torch.randn(80, 3, generator=gen).T  # (3, 80), not contiguous
    assert torch.equal(ops.linear_rows(strided, w), ops.linear_rows(strided.contiguous(), w))
    threads = torch.get_num_threads()
    try:
        big = torch.randn(2048, 576, generator=gen)
        xb = torch.randn(1, 576, generator=gen)
        torch.set_num_threads(1)
        one = ops.linear_rows(xb, big)
        torch.set_num_threads(max(2, threads))
        assert torch.equal(ops.linear_rows(xb, big), one)
    finally:
        torch.set_num_threads(threads)


def test_linear_rows_in_bfloat16_matches_the_float64_sum_rounded_once(ops, isa):
    """bfloat16 weights and rows, float32 sums, one rounding at the end (as the eager linear)."""
    gen = torch.Generator().manual_seed(4)
    for n, k in [(70, 80), (576, 576), (130, 37)]:
        w = torch.randn(n, k, generator=gen).bfloat16()
        for rows in (1, 4):
            x = torch.randn(rows, k, generator=gen).bfloat16()
            got = ops.linear_rows(x, w)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
            want = F.linear(x.double(), w.double())
            scale = (x.double().abs() @ w.double().abs().T)
            # one bfloat16 rounding (2^-9 relative) plus float32 summation of |products|
            assert ((got.double() - want).abs() <= want.abs() * 2 ** -8 + 4e-7 * scale * k ** 0.5).all()
            assert torch.equal(ops.linear_rows(x[:1], w)[0], got[0])


def test_linear_rows_refuses_what_it_does_not_run(ops):
    w = torch.randn(16, 32)
    with pytest.raises(RuntimeError, match="at most 4 rows"):
        ops.linear_rows(torch.randn(5, 32), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.linear_rows(torch.randn(1, 32).bfloat16(), w)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        ops.linear_rows(torch.randn(1, 32).half(), w.half())
    with pytest.raises(RuntimeError, match="contiguous"):
        ops.linear_rows(torch.randn(1, 32), torch.randn(32, 16).T)
    with pytest.raises(RuntimeError, match="activation width"):
        ops.linear_rows(torch.randn(1, 31), w)


def test_paged_attention_refuses_out_of_range_slots_and_blocks(ops):
    from ferrum_rpc.server.kv.pool import KvPool
    from ferrum_rpc.server.kernels.rope import rope_tables
    from types import SimpleNamespace

    cos, sin = rope_tables(SimpleNamespace(head_dim=16, rope_theta=1e4, max_position_embeddings=64),
                           torch.device("cpu"))
    pool = KvPool(1, 4, 4, 2, 16, torch.float32, torch.device("cpu"))
    kv = pool.batch([[1, 2]], [3], [1])
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 2, 16)
    args = (q, k, k, cos, sin, kv.positions, pool.k[0], pool.v[0])
    ops.paged_attention(*args, kv.write_slots, kv.tables, 0.25)  # in range: runs
    with pytest.raises(RuntimeError, match="write slot out of range"):
        ops.paged_attention(*args, kv.write_slots + 1000, kv.tables, 0.25)
    with pytest.raises(RuntimeError, match="block id out of range"):
        ops.paged_attention(*args, kv.write_slots, kv.tables + 100, 0.25)


def test_step_ops_choice(ops):
    cpu = torch.device("cpu")
    assert choose_step_ops("eager", torch.float32, cpu) == (False, "eager (forced by configuration)")
    on, why = choose_step_ops("auto", torch.float32, cpu)
    assert on and why.startswith("fused (built and probed OK")
    assert choose_step_ops("fused", torch.bfloat16, cpu)[0]
    with pytest.raises(ValueError, match="one of"):
        choose_step_ops("fast", torch.float32, cpu)
    assert build.load_library.cache_info().currsize == 1  # built and loaded once per process


@pytest.mark.parametrize("arch,quantize", [  # llama-q4: Q4_1-grid weights, which w8a8 rotates
    (arch, quantize) for arch in ("llama", "qwen3")
    for quantize in ("none", "none-bfloat16", "int8", "int4", "w8a8", "w4a8")] + [("llama-q4", "w8a8")])
def test_whole_layer_op_equals_the_per_op_path(tiny_llama_dir, tiny_qwen3_dir, tiny_q4_llama_dir, arch, quantize,
                                               ops):
    """Not batch-invariant: --quantize models (and float32 ones, whose linears run linear_rows:
    forwards of up to 4 rows) with plain Llama or Qwen3 blocks (q/k RMSNorm inside the op) run
    each decode-sized layer as one op (decode_layer); it must give what the per-op fused
    path gives."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor
    from ferrum_rpc.types import LogitsPolicy

    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "llama-q4": tiny_q4_llama_dir}[arch]
    quantize, _, dtype = quantize.partition("-")
    ex = TorchExecutor.from_path("tiny", model_dir, ExecutorConfig(kv_tokens=256, block_size=4, quantize=quantize,
                                                                    dtype=dtype or "float32", batch_invariant="off"))
    assert ex.model.layer_ops is not None and ex.model.layer_ops.size() == 2
    assert ex.model.layer_ops.one_region() == (quantize != "none")  # every linear quantizes its activations
    assert all(rotated == [int(arch == "llama-q4" and quantize == "w8a8")] * 4
               for *_, rotated, _ in ex.model._whole_layer_args())
    assert ex.model.layer_ops_dtype == (torch.bfloat16 if dtype else torch.float32)
    tol = TOL[torch.bfloat16] if dtype else 1e-5
    full = LogitsPolicy.full()
    twins = [ex.prefill([5, 17, 101, 3, 250, 42], None, full).kv_cache for _ in range(2)]
    whole = ex.decode(7, twins[0], full)
    saved, ex.model.layer_ops = ex.model.layer_ops, None
    try:
        per_op = ex.decode(7, twins[1], full)
    finally:
        ex.model.layer_ops = saved
    assert rel(whole.logits.values, per_op.logits.values) <= tol
    # a verify of 3 rows (still decode-sized) too, on both sequences
    a = ex.forward_verify([1, 2, 3], whole.kv_cache, full)
    ex.model.layer_ops = None
    try:
        b = ex.forward_verify([1, 2, 3], per_op.kv_cache, full)
    finally:
        ex.model.layer_ops = saved
    assert rel(a.logits.values, b.logits.values) <= tol
    assert ex.model.layer_ops_rows == ((2 if dtype else 4) if quantize == "none" else None)
    if quantize == "none":  # 6 rows are past linear_rows: the per-op path runs them, op or no op
        c = ex.forward_verify([4, 5, 6, 7, 8, 9], a.kv_cache, full)
        ex.model.layer_ops = None
        try:
            d = ex.forward_verify([4, 5, 6, 7, 8, 9], b.kv_cache, full)
        finally:
            ex.model.layer_ops = saved
        assert rel(c.logits.values, d.logits.values) <= tol  # their KV differs by the rounding above


QACT_CAPS = [("avx512", "avx512-vnni"), ("avx512", "avx-vnni"), ("avx2", "avx2"), ("portable", "portable")]


@pytest.fixture(params=QACT_CAPS, ids=[q for _, q in QACT_CAPS])
def qact_cap(request, ops):
    """Each inner-loop build of the packed linears (and the fused ops under it) this CPU runs."""
    fused_cap, qact_isa = request.param
    torch.ops.ferrum_woq.set_max_isa(fused_cap)
    ran = torch.ops.ferrum_qact.set_max_isa(qact_isa)
    try:
        if ran != qact_isa or torch.ops.ferrum_woq.isa() != fused_cap:
            pytest.skip(f"this CPU cannot run the {qact_isa} path")
        yield qact_isa
    finally:
        torch.ops.ferrum_woq.set_max_isa("avx512")
        torch.ops.ferrum_qact.set_max_isa("avx512-vnni")


@pytest.mark.parametrize("arch,quantize,kv", [("llama", "w4a8", "float32"), ("llama-q4", "w8a8", "float32"),
                                              ("qwen3", "int4", "float32"), ("qwen3", "w8a8", "float32"),
                                              ("llama", "w4a8", "bfloat16"), ("qwen3", "w8a8", "bfloat16")])
def test_decode_stack_in_one_region_equals_decode_layer_per_layer(tiny_llama_dir, tiny_qwen3_dir, tiny_q4_llama_dir,
                                                                   arch, quantize, kv, qact_cap, stack_cases):
    """DecodeStack runs a step of up to 4 rows as one parallel region (the threads
    share out each phase, meeting at barriers); each output is the same kernel's
    arithmetic as decode_layer's, so the hidden states and the pool's new K and V
    must be the same bits, on every inner-loop path, for layers [first, last) too,
    with every thread norming every row of a 1-2 row step or its share of them,
    and 5 rows (past the region: decode_layer per layer inside); over a float32
    pool or a bfloat16 one (--kv-dtype)."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "llama-q4": tiny_q4_llama_dir}[arch]
    config = ExecutorConfig(kv_tokens=64, quantize=quantize, batch_invariant=False)  # decode_layer's silu past 4 rows
    model = TorchExecutor.from_path("tiny", model_dir, config).model
    stack, layers, cfg = model.layer_ops, model._whole_layer_args(), model.config
    assert stack.one_region() and stack.size() == len(layers) == 2
    try:
        for c in stack_cases(model, [(1, 1), (2, 1), (1, 3), (2, 2), (5, 1)], 3, kv_dtype=getattr(torch, kv)):
            for whole in (2, 0):  # 1-2 rows: every thread norms every row (default), or its share
                stack.set_whole_rows(whole)
                got_k, got_v = c.pool[0].clone(), c.pool[1].clone()
                got = stack.forward(c.x, *c.step, got_k, got_v, c.slots, c.tables, c.first, c.last)
                assert torch.equal(got, c.want), (c.B, c.T, c.first, c.last, whole)
                assert torch.equal(got_k, c.want_k) and torch.equal(got_v, c.want_v)
    finally:
        stack.set_whole_rows(2)
    x, step, pool, slots, tables = c.x, c.step, c.pool, c.slots, c.tables  # the last case's
    positions = step[2]
    with pytest.raises(RuntimeError, match="layers 1..3 of 2"):
        stack.forward(x, *step, got_k, got_v, slots, tables, 1, 3)
    with pytest.raises(RuntimeError, match="cos/sin must be"):  # a sin table shorter than cos
        stack.forward(x, model.rope_cos, model.rope_sin[:8], positions, got_k, got_v, slots, tables, 0, 2)
    # norm weights as strided views (the region reads them by pointer): the same bits
    strided = torch.classes.ferrum_fused.DecodeStack(cfg.num_heads, cfg.num_kv_heads, 1 / cfg.head_dim ** 0.5)
    for ln1, *rest in layers:
        strided.add_layer(torch.stack([ln1, -ln1], 1)[:, 0], *rest)
    a, b = (s.forward(x[:2], *step[:2], positions[:2], pool[0].clone(), pool[1].clone(), slots[:2], tables[:2], 0, 2)
            for s in (stack, strided))  # the last case's first two sequences, a token each
    assert strided.one_region() and torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_tiled_equals_linear_rows_bit_for_bit_at_every_row_count(ops, isa, dtype):
    """The blocked kernel (8 rows and more) and the 1-4 row kernel give a row the same
    bits: every row count 1..70 against each row alone through linear_rows, with K
    that leaves every kind of remainder (blocks past the last whole four, a scalar
    tail) and N that leaves partial weight panels."""
    gen = torch.Generator().manual_seed(11)
    for n, k in [(13, 576), (7, 200), (20, 83), (5, 1024)]:
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(70, k, generator=gen).to(dtype)
        alone = torch.cat([ops.linear_rows(x[i:i + 1], w) for i in range(70)])
        for rows in range(1, 71):
            got = ops.linear_rows_tiled(x[:rows], w)
            assert torch.equal(got, alone[:rows]), (n, k, rows)
        assert torch.equal(ops.linear_rows(x[:4], w), alone[:4])  # 4 rows sharing each weight load


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_rows_tiled_gives_a_row_the_same_bits_in_any_batch(ops, isa, dtype):
    """The batch-invariant linear: any row count (tiles of 64 and remainders of the 4-,
    2- and 1-row groups), each row's output bit-identical alone, in any subset and
    order of the others, and close to the float64 sum."""
    gen = torch.Generator().manual_seed(5)
    for n, k in [(70, 80), (300, 576), (130, 37)]:
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(150, k, generator=gen).to(dtype)
        full = ops.linear_rows_tiled(x, w)
        for rows in (1, 2, 3, 5, 64, 65, 129):
            pick = torch.randperm(150, generator=gen)[:rows]
            assert torch.equal(ops.linear_rows_tiled(x[pick], w), full[pick])
        want = F.linear(x.double(), w.double())
        scale = (x.double().abs() @ w.double().abs().T).max().item()
        tolerance = (4e-7 if dtype == torch.float32 else 8e-3) * scale * k ** 0.5
        assert (full.double() - want).abs().max().item() <= tolerance


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,quantize,invariant", [("float32", "w4a8", False), ("float32", "int8", False),
                                                      ("float32", "none", True), ("bfloat16", "none", True)])
def test_a_step_from_token_ids_equals_the_embedding_the_stack_and_the_norm_one_by_one(
        tiny_llama_dir, tiny_qwen3_dir, ops, isa, arch, dtype, quantize, invariant):
    """DecodeStack.forward_ids (the model's forward where the stack takes every layer):
    the embedding rows, the layers and the final norm in one call give the hidden
    states and the pool's new K and V bits that the three ops give one after the
    other; for a decode of one and of two rows, and a 3-token prompt part; a token id
    outside the vocabulary is refused, not read."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[arch]
    ex = TorchExecutor.from_path("tiny", model_dir, ExecutorConfig(kv_tokens=128, block_size=4, dtype=dtype,
                                                                   quantize=quantize, batch_invariant=invariant))
    model = ex.model
    assert model.layer_ops is not None
    seqs = [ex.kv.get(ex.prefill(prompt).kv_cache.cache_id) for prompt in ([5, 17, 101, 3, 250, 42], [9, 8, 7])]
    for batch, tokens in [(1, 1), (2, 1), (1, 3)]:
        picked = seqs[:batch]
        for seq in picked:  # blocks for the new tokens
            ex.kv.prepare_write(seq, seq.length, seq.length + tokens)
        kv = ex.pool.batch([s.block_ids for s in picked], [s.length for s in picked], [tokens] * batch)
        ids = torch.tensor([[11 + 13 * b + t for t in range(tokens)] for b in range(batch)])
        before = ex.pool.k.clone(), ex.pool.v.clone()
        with torch.inference_mode():
            assert model._whole_step(ids, kv.positions, kv)
            want = model(ids, kv.positions, kv, {})  # a capture dict: the ops one by one
            want_k, want_v = ex.pool.k.clone(), ex.pool.v.clone()
            ex.pool.k.copy_(before[0]), ex.pool.v.copy_(before[1])
            got = model(ids, kv.positions, kv)
        assert torch.equal(got, want), (batch, tokens)
        assert torch.equal(ex.pool.k, want_k) and torch.equal(ex.pool.v, want_v)
        assert not torch.equal(want_k, before[0])  # the step wrote its keys
    kv = ex.pool.batch([seqs[0].block_ids], [seqs[0].length], [1])
    with pytest.raises(RuntimeError, match="outside the vocabulary"), torch.inference_mode():
        model(torch.tensor([[model.config.vocab_size]]), kv.positions, kv)
