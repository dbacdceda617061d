"""csrc/panel_gemm.cpp: the batch-invariant float linear (each output one chain over K)
against a float64 reference, and a row's bits alone, in any block of rows, at the
tiles' edges and on any thread count, on every inner-loop path this CPU has."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ferrum_rpc.server.kernels import fused

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# (N, K): a partial last panel, a K below a pair, an odd K, a panel exactly, SmolLM2's width
SHAPES = [(13, 576), (70, 83), (16, 1), (40, 64)]


@pytest.fixture(scope="module")
def ops():
    ok, why = fused.probe_fused(torch.float32)
    assert ok, f"the fused ops should build and agree on this machine: {why}"
    return torch.ops.ferrum_fused


def run(ops, x, w):
    return ops.panel_linear(x, ops.pack_panels(w), w.shape[0])


def test_bfloat16_outputs_are_rounded_as_torch_rounds(ops, isa, dot):
    """Each bfloat16 output is its float32 sum rounded once as torch rounds it (to nearest,
    ties to even, subnormals kept, overflow to infinity), on every path, at every column of
    a row (the vector stores and their tails); a row with a NaN gives NaN."""
    gen = torch.Generator().manual_seed(9)
    a = torch.randn(40, generator=gen) * torch.logspace(-30, 30, 40)
    a = torch.cat([a, torch.tensor([1.0, 1.0, 3.0, 3e38, -3e38, 1.5])]).bfloat16()
    b = torch.cat([torch.randn(40, generator=gen) * 2.0 ** -9 * a[:40].float().abs(),
                   torch.tensor([2.0 ** -8, 3 * 2.0 ** -8, 2.0 ** -7, 3e38, -3e38, -1.5 + 2.0 ** -20])]).bfloat16()
    if not ops.panel_dot_runs():  # subnormal sums (the dot product flushes them to zero)
        a = torch.cat([a, torch.tensor([2.0 ** -130, 2.0 ** -130, -(2.0 ** -128)]).bfloat16()])
        b = torch.cat([b, torch.tensor([2.0 ** -134, 3 * 2.0 ** -134, 2.0 ** -137]).bfloat16()])
    # output j = a[j] * 1 + b[j] * 1: the two products exact, their sum one float32 rounding
    n = len(a)
    w = torch.zeros(n, 2 * n, dtype=torch.bfloat16)
    w[torch.arange(n), 2 * torch.arange(n)] = 1.0
    w[torch.arange(n), 2 * torch.arange(n) + 1] = 1.0
    x = torch.stack([a, b], dim=1).reshape(1, 2 * n).repeat(3, 1)
    x[2, 5] = float("nan")
    got = ops.panel_linear(x, ops.pack_panels(w), n)
    want = (a.float() + b.float()).bfloat16()
    assert want[-4 if ops.panel_dot_runs() else -7:].isinf().sum() == 2
    for row in got[:2]:
        assert torch.equal(row.view(torch.int16), want.view(torch.int16))
    assert got[2].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompt_sized_block_keeps_each_rows_bits(ops, isa, dtype):
    """Blocks of 128 rows or more (a prompt's) run as units of rows and panels taken by
    whichever thread is free: each row's bits are still its bits alone, on 1 or 2 threads,
    with a partial last unit of rows and of panels."""
    gen = torch.Generator().manual_seed(8)
    w = torch.randn(16 * 13 + 5, 96, generator=gen).to(dtype)
    x = torch.randn(301, 96, generator=gen).to(dtype)
    panels = ops.pack_panels(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = ops.panel_linear(x, panels, w.shape[0])
        rows = [ops.panel_linear(x[i:i + 1], panels, w.shape[0]) for i in range(0, 301, 7)]
        assert torch.equal(torch.cat(rows), full[::7])
        assert torch.equal(ops.panel_linear(x[3:131], panels, w.shape[0]), full[3:131])
        torch.set_num_threads(1)
        assert torch.equal(ops.panel_linear(x, panels, w.shape[0]), full)
    finally:
        torch.set_num_threads(threads)
    want = F.linear(x.double(), w.double())
    assert (full.double() - want).abs().max() / want.abs().max() < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_is_close_to_float64_and_a_row_has_the_same_bits_in_any_block(ops, isa, dtype):
    gen = torch.Generator().manual_seed(3)
    for n, k in SHAPES:
        w = torch.randn(n, k, generator=gen).to(dtype)
        x = torch.randn(70, k, generator=gen).to(dtype)
        panels = ops.pack_panels(w)
        full = ops.panel_linear(x, panels, n)
        want = F.linear(x.double(), w.double())
        assert (full.double() - want).abs().max() / want.abs().max() < TOL[dtype], (n, k)
        alone = torch.cat([ops.panel_linear(x[i:i + 1], panels, n) for i in range(70)])
        assert torch.equal(alone, full), (n, k)
        for rows in range(2, 71):  # every row tile and its edges: blocks of 2..70 at two offsets
            assert torch.equal(ops.panel_linear(x[:rows], panels, n), full[:rows]), (n, k, rows)
            start = 70 - rows
            assert torch.equal(ops.panel_linear(x[start:], panels, n), full[start:]), (n, k, rows)
        pick = torch.randperm(70, generator=gen)[:23]
        assert torch.equal(ops.panel_linear(x[pick], panels, n), full[pick])
        assert torch.equal(ops.panel_linear(x.view(7, 10, k), panels, n).view(70, n), full)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_gives_the_same_bits_on_one_and_two_threads(ops, isa, dtype):
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(1000, 96, generator=gen).to(dtype)  # 63 panels: the threads split them unevenly
    x = torch.randn(37, 96, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(ops, x, w)
        torch.set_num_threads(2)
        two = run(ops, x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.fixture(params=[True, False], ids=["dot", "no-dot"])
def dot(request, ops):
    """bfloat16 on the AVX-512 BF16 dot product where the CPU has it, or (no-dot) on the
    AVX-512 multiply-add path a CPU without it takes."""
    ops.set_panel_dot(request.param)
    yield request.param
    ops.set_panel_dot(True)


def test_the_fused_multiply_add_paths_give_the_same_bits(ops, dot):
    """One chain of fused multiply-adds per output whatever the vector width: float32 on
    every path alike, and bfloat16 on every path but the AVX-512 BF16 dot product."""
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(11, 77, generator=gen), torch.randn(35, 77, generator=gen)
    got = {}
    try:
        for cap in ("avx512", "avx2", "portable"):
            if torch.ops.ferrum_woq.set_max_isa(cap) == cap:
                got[cap] = (run(ops, x, w), run(ops, x.bfloat16(), w.bfloat16()))
    finally:
        torch.ops.ferrum_woq.set_max_isa("avx512")
    assert "portable" in got
    for cap, (f32, bf16) in got.items():
        assert torch.equal(f32, got["portable"][0]), cap
        if cap != "avx512" or not dot:  # AVX-512 takes the dot product for bfloat16 where allowed and present
            assert torch.equal(bf16, got["portable"][1]), cap


def test_the_avx512_multiply_add_path_keeps_a_rows_bits_in_bfloat16(ops):
    """The path an AVX-512 CPU without BF16 takes for bfloat16 (here: the dot product
    turned off): a row alone and in blocks of 2..70 rows, close to float64."""
    if torch.ops.ferrum_woq.set_max_isa("avx512") != "avx512":
        pytest.skip("this CPU cannot run the avx512 path")
    gen = torch.Generator().manual_seed(6)
    w, x = torch.randn(40, 83, generator=gen).bfloat16(), torch.randn(70, 83, generator=gen).bfloat16()
    panels = ops.pack_panels(w)
    ops.set_panel_dot(False)
    try:
        full = ops.panel_linear(x, panels, 40)
        assert all(torch.equal(ops.panel_linear(x[:rows], panels, 40), full[:rows]) for rows in range(1, 71))
        assert torch.equal(torch.cat([ops.panel_linear(x[i:i + 1], panels, 40) for i in range(70)]), full)
    finally:
        ops.set_panel_dot(True)
    want = F.linear(x.double(), w.double())
    assert (full.double() - want).abs().max() / want.abs().max() < TOL[torch.bfloat16]


def test_panel_linear_refuses_what_it_does_not_run(ops):
    w = torch.randn(20, 32)
    panels = ops.pack_panels(w)
    with pytest.raises(RuntimeError, match="alike"):
        ops.panel_linear(torch.randn(2, 32).bfloat16(), panels, 20)
    with pytest.raises(RuntimeError, match="pack_panels"):
        ops.panel_linear(torch.randn(2, 31), panels, 20)
    with pytest.raises(RuntimeError, match="pack_panels"):
        ops.panel_linear(torch.randn(2, 32), panels, 40)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        ops.pack_panels(w.half())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_invariant_model_runs_panel_linear_and_its_whole_layer_op_gives_the_per_op_bits(tiny_llama_dir, ops,
                                                                                           dtype):
    """--batch-invariant: every float linear (the LM head too) on its packed panels, and
    the whole-layer op, rebuilt on them, takes forwards of any size with the per-op
    path's bits (a decode, a 6-row verify)."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor
    from ferrum_rpc.server.models.linear import FastLinear
    from ferrum_rpc.types import LogitsPolicy

    ex = TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=256, block_size=4, dtype=dtype,
                                                                        batch_invariant=True))
    model = ex.model
    linears = [m for m in model.modules() if isinstance(m, FastLinear)]
    assert linears and all(m.panels is not None for m in linears) and model.lm_head in linears
    assert model.kernels.linear == "panel_gemm"
    assert model.layer_ops is not None and model.layer_ops_rows is None
    full = LogitsPolicy.full()
    twins = [ex.prefill([5, 17, 101, 3, 250, 42], None, full).kv_cache for _ in range(2)]
    saved = model.layer_ops

    def both(step):
        whole = step(twins[0])
        model.layer_ops = None
        try:
            per_op = step(twins[1])
        finally:
            model.layer_ops = saved
        assert torch.equal(whole.logits.values, per_op.logits.values)
        twins[:] = [whole.kv_cache, per_op.kv_cache]

    both(lambda kv: ex.decode(7, kv, full))
    both(lambda kv: ex.forward_verify([4, 5, 6, 7, 8, 9], kv, full))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,kv", [("float32", "float32"), ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
def test_the_panels_step_in_one_region_equals_decode_layer_per_layer(tiny_llama_dir, tiny_qwen3_dir, ops, isa, dot,
                                                                     arch, dtype, kv, stack_cases):
    """An invariant float model's step of up to 4 rows runs as one parallel region
    (each linear's panels shared out between the threads, meeting at barriers); each
    output is the per-op path's arithmetic, so the hidden states and the pool's new
    K and V are decode_layer's bits, on every inner-loop path, on 1 and 2 threads
    (each norming every row of a 1-2 row step, or its share),
    for layers [first, last) too, over a pool in the activations' dtype or bfloat16
    under float32 (--kv-dtype)."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[arch]
    model = TorchExecutor.from_path("tiny", model_dir, ExecutorConfig(kv_tokens=64, dtype=dtype,
                                                                      batch_invariant=True)).model
    stack = model.layer_ops
    assert stack.panels_region() and not stack.one_region() and stack.size() == 2
    threads = torch.get_num_threads()
    try:
        for c in stack_cases(model, [(1, 1), (2, 1), (1, 3), (2, 2)], 5, getattr(torch, dtype), getattr(torch, kv)):
            # off: a layer_step a layer; whole 0: each thread norms its share of a 1-2 row step's rows
            for n, regions, whole in ((1, True, 2), (2, True, 2), (2, True, 0), (2, False, 2)):
                torch.set_num_threads(n)
                stack.set_regions(regions)
                stack.set_whole_rows(whole)
                got_k, got_v = c.pool[0].clone(), c.pool[1].clone()
                got = stack.forward(c.x, *c.step, got_k, got_v, c.slots, c.tables, c.first, c.last)
                assert torch.equal(got, c.want), (c.B, c.T, c.first, c.last, n, regions, whole)
                assert torch.equal(got_k, c.want_k) and torch.equal(got_v, c.want_v)
    finally:
        torch.set_num_threads(threads)
        stack.set_regions(True)
        stack.set_whole_rows(2)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("dtype,quantize", [("float32", "none"), ("bfloat16", "none"), ("float32", "w4a8"),
                                            ("float32", "int8")])
def test_a_batch_invariant_step_of_any_size_runs_as_one_region_with_the_per_layer_bits(
        tiny_llama_dir, tiny_qwen3_dir, ops, isa, arch, dtype, quantize):
    """The batch-invariant model (float panels, or linears that quantize their
    activations) runs a forward of any number of rows as one parallel region, its
    silu*up on the per-row loops as layer_step's: batches of 8 and 21 rows and a
    40-token prompt part give layer_step's bits (set_regions(False)), hidden states
    and the pool's new K and V, on 1 and 2 threads and on every inner-loop path."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir}[arch]
    model = TorchExecutor.from_path("tiny", model_dir, ExecutorConfig(kv_tokens=64, dtype=dtype, quantize=quantize,
                                                                      batch_invariant=True)).model
    stack, cfg = model.layer_ops, model.config
    assert (stack.panels_region() if quantize == "none" else stack.one_region()) and stack.size() == 2
    gen, bs = torch.Generator().manual_seed(11), 4
    threads = torch.get_num_threads()
    try:
        for B, T in [(8, 1), (3, 7), (1, 40)]:
            per = (T + 8 + bs - 1) // bs  # blocks a sequence holds: its own, none shared
            tables = torch.randperm(B * per, generator=gen).view(B, per)
            positions = torch.stack([torch.arange(T) + 2 + 3 * b % 7 for b in range(B)])
            slots = (tables.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
            kv = torch.float32 if quantize != "none" else getattr(torch, dtype)
            pool = [torch.randn(2, B * per, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(kv)
                    for _ in range(2)]
            x = torch.randn(B, T, cfg.hidden_size, generator=gen).to(getattr(torch, dtype if quantize == "none"
                                                                               else "float32"))
            runs = []
            for n, regions in ((2, False), (1, True), (2, True)):
                torch.set_num_threads(n)
                stack.set_regions(regions)
                k, v = pool[0].clone(), pool[1].clone()
                runs.append((stack.forward(x, model.rope_cos, model.rope_sin, positions, k, v, slots, tables, 0, 2),
                             k, v))
            want = runs[0]
            assert want[0].isfinite().all()
            for got in runs[1:]:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), (B, T)
    finally:
        torch.set_num_threads(threads)
        stack.set_regions(True)
