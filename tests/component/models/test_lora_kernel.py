"""lora.cpp's per-row LoRA deltas (``LoraBatch``) against float64 torch on every
inner-loop build this CPU can run, float32 and bfloat16: ranks and widths that fill
no whole block, rows of several adapters interleaved with base rows, projections an
adapter leaves alone; and a row's bits whatever rows and adapters share its call
(the batch-invariant mode's promise).  Whole-model parity with transformers + peft,
on the decode stack and the per-op path, is in test_lora.py."""

from __future__ import annotations

import pytest
import torch

from ferrum_rpc.server.kernels import fused
from ferrum_rpc.server.models.lora import SITES, SiteWeights, _pack

K, WIDTHS = 43, (72, 24, 24)  # a fused q|k|v of widths past whole 32-output blocks, K past whole 8-blocks


@pytest.fixture(scope="module")
def ops():
    ok, why = fused.probe_fused(torch.float32)
    assert ok, f"the fused ops should build here: {why}"
    return torch.classes.ferrum_fused


def make_site(gen: torch.Generator, ranks: dict[int, int], dtype: torch.dtype, widths=WIDTHS) -> SiteWeights:
    """A fused-projection site: module i (of ``widths``) with rank ranks[i], the others untouched."""
    a_parts, segments, r_lo, out_lo = [], [], 0, 0
    for i, width in enumerate(widths):
        if i in ranks:
            a_parts.append(torch.randn(ranks[i], K, generator=gen))
            b = torch.randn(width, ranks[i], generator=gen) / ranks[i] ** 0.5
            segments.append((out_lo, width, r_lo, _pack(b.to(dtype))))
            r_lo += ranks[i]
        out_lo += width
    return SiteWeights(torch.cat(a_parts).to(dtype), segments)


def as_kernel(ops, site: SiteWeights, layer: int = 1, layers: int = 2):
    kernel = ops.LoraAdapter(layers)
    out_lo, widths, r_lo, packed = zip(*site.segments)
    kernel.set_site(layer, SITES["qkv_proj"], site.a, list(packed), list(widths), list(out_lo), list(r_lo))
    return kernel


def want_delta(site: SiteWeights, x: torch.Tensor, widths=WIDTHS) -> torch.Tensor:
    """The delta of rows x in float64, from the packed weights unpacked by hand."""
    low = x.double() @ site.a.double().t()
    out = torch.zeros(len(x), sum(widths), dtype=torch.float64)
    for out_lo, width, r_lo, packed in site.segments:
        b = packed.double().transpose(1, 2).reshape(-1, packed.shape[1])[:width]  # (width, rank)
        out[:, out_lo:out_lo + width] = low[:, r_lo:r_lo + b.shape[1]] @ b.t()
    return out


SITE_RANKS = [{0: 16, 1: 16, 2: 16}, {0: 3, 2: 5}, {1: 64}]  # all modules; q and v, odd ranks; k alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_its_adapters_delta(ops, isa, dtype):
    gen = torch.Generator().manual_seed(0)
    sites = [make_site(gen, ranks, dtype) for ranks in SITE_RANKS]
    rows = torch.tensor([2, -1, 0, 1, 0, 0, -1, 2, 1, 1, 0])  # interleaved, base rows among them, runs of 1-3
    batch = ops.LoraBatch(rows)
    for site in sites:
        batch.add_adapter(as_kernel(ops, site))
    x = torch.randn(len(rows), K, generator=gen).to(dtype)
    y0 = torch.randn(len(rows), sum(WIDTHS), generator=gen).to(dtype)
    y = batch.add(1, SITES["qkv_proj"], x, y0.clone())
    want = y0.double().clone()
    for m, a in enumerate(rows.tolist()):
        if a >= 0:
            want[m] += want_delta(sites[a], x[m:m + 1])[0]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.double(), want, atol=tol * want.abs().max().item(), rtol=0)
    assert torch.equal(y[rows == -1], y0[rows == -1])  # base rows untouched
    # layer 0 and the other projections: the adapters leave them alone
    assert torch.equal(batch.add(0, SITES["qkv_proj"], x, y0.clone()), y0)
    assert torch.equal(batch.add(1, SITES["o_proj"], x[:, :24], y0[:, :24].clone()), y0[:, :24])


def test_a_rows_bits_do_not_depend_on_its_batch(ops, isa, monkeypatch):
    """One row with adapter 0, alone, beside others of its adapter (taken two at a
    time), among other adapters' rows and base rows, and at 1 and 2 threads: the same bits."""
    gen = torch.Generator().manual_seed(1)
    sites = [make_site(gen, ranks, torch.float32) for ranks in SITE_RANKS]
    kernels = [as_kernel(ops, site) for site in sites]
    xs = torch.randn(256, K, generator=gen)
    y0 = torch.randn(256, sum(WIDTHS), generator=gen)

    def delta_of_row0(rows: list[int], threads: int) -> torch.Tensor:
        batch = ops.LoraBatch(torch.tensor(rows))
        for kernel in kernels:
            batch.add_adapter(kernel)
        torch.set_num_threads(threads)
        return batch.add(1, SITES["qkv_proj"], xs[:len(rows)], y0[:len(rows)].clone())[0]

    threads = torch.get_num_threads()
    try:
        alone = delta_of_row0([0], 1)
        for rows in ([0, 0], [0, 1, 0, 2], [0] + [1, 2, -1, 0] * 15 + [1, 0, 2], [0] * 256):  # the last: threads split it
            for n in (1, 2):
                assert torch.equal(delta_of_row0(rows, n), alone), (rows, n)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_deltas_in_the_linears_region_give_the_bits_of_the_linear_then_the_deltas(ops, isa, dtype):
    """``LoraBatch.linear`` (the decode stack's float linears: the deltas inside
    linear_rows' parallel region, each thread those of its own outputs) against
    linear_rows then ``add``: the same bits, at 1 and 2 threads, for 1-4 rows of
    several adapters and base rows; widths whose thread split falls inside a packed
    block; and the float64 sum."""
    gen = torch.Generator().manual_seed(3)
    widths = (200, 72, 72)  # 344 outputs: two threads split them at 160, inside q's sixth block
    sites = [make_site(gen, ranks, dtype, widths) for ranks in SITE_RANKS]
    kernels = [as_kernel(ops, site) for site in sites]
    w = torch.randn(sum(widths), K, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        for rows in ([0], [1], [2, 2], [0, -1, 1, 0], [-1, 2, 2, -1]):
            batch = ops.LoraBatch(torch.tensor(rows))
            for kernel in kernels:
                batch.add_adapter(kernel)
            x = torch.randn(len(rows), K, generator=gen).to(dtype)
            for n in (1, 2):
                torch.set_num_threads(n)
                got = batch.linear(1, SITES["qkv_proj"], x, w)
                assert torch.equal(got, batch.add(1, SITES["qkv_proj"], x, torch.ops.ferrum_fused.linear_rows(x, w))), (rows, n)
            assert torch.equal(batch.linear(0, SITES["qkv_proj"], x, w), torch.ops.ferrum_fused.linear_rows(x, w))  # no site there
            want = x.double() @ w.double().t()
            for m, a in enumerate(rows):
                if a >= 0:
                    want[m] += want_delta(sites[a], x[m:m + 1], widths)[0]
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got.double(), want, atol=tol * want.abs().max().item(), rtol=0)
    finally:
        torch.set_num_threads(threads)


def test_refusals_name_the_mismatch(ops):
    gen = torch.Generator().manual_seed(2)
    site = make_site(gen, SITE_RANKS[0], torch.float32)
    batch = ops.LoraBatch(torch.tensor([0, -1]))
    batch.add_adapter(as_kernel(ops, site))
    with pytest.raises(RuntimeError, match="x has width 42"):
        batch.add(1, 0, torch.zeros(2, K - 1), torch.zeros(2, sum(WIDTHS)))
    with pytest.raises(RuntimeError, match="outputs up to 120 of 100"):
        batch.add(1, 0, torch.zeros(2, K), torch.zeros(2, 100))
    with pytest.raises(RuntimeError, match="must have 2 rows"):
        batch.add(1, 0, torch.zeros(3, K), torch.zeros(3, sum(WIDTHS)))
    with pytest.raises(RuntimeError, match="names adapter 1 of 1"):
        bad = ops.LoraBatch(torch.tensor([1]))
        bad.add_adapter(as_kernel(ops, site))
        bad.add(1, 0, torch.zeros(1, K), torch.zeros(1, sum(WIDTHS)))
    kernel = ops.LoraAdapter(2)
    with pytest.raises(RuntimeError, match="reads ranks 0..17 of 16"):
        kernel.set_site(0, 0, site.a[:16].contiguous(), [_pack(torch.zeros(8, 17))], [8], [0], [0])
