"""Integer arithmetic on quantized activations (``--quantize w8a8|w4a8``): the
kernel (csrc/qact.cpp) on every inner-loop build this CPU has, and its torch
fallback, against a float reference with stated tolerances and against the
same quantized numbers, rows independent of the batch they share, and whole-model parity with
transformers on our weights, through gRPC.  The real model's top-1 agreement
with float32 is in tests/system/test_default_model.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.server.kernels import qact, woq
from ferrum_rpc.errors import StartupError
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.models import load_model
from tests.conftest import running_server
from tests.component.kernels.test_woq import _gguf_blocks, _oracle_with_our_weights

# Of the output's largest magnitude.  Against the float reference (unquantized
# activations, the layer's own weights) the activation grid is the whole error:
# per element up to amax/254 of its half block of 16 (w8a8, w4a8), averaging out over K products;
# measured 0.4-0.8% at K = 160..576.
FLOAT_TOL = 0.02
# Two digits (int8, int4): the remainder's grid, amax/32258 per element at most.
FLOAT_TOL_2 = 2e-4
SAME_NUMBERS_TOL = 2e-5  # kernel vs the same int8 codes in torch: float summation order only


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()


ISAS = ["avx512-vnni", "avx-vnni", "avx2", "portable"]  # csrc/qact.cpp's inner loops, best first


@pytest.fixture(scope="module")
def extension():
    ok, why = qact.probe()
    assert ok, f"the w8a8/w4a8 kernel should build and agree on this machine: {why}"
    return torch.ops.ferrum_qact


@pytest.fixture(params=ISAS)
def isa(request, extension):
    """Each inner-loop build this CPU can run (the others are skipped, and named)."""
    ran = extension.set_max_isa(request.param)
    if ran != request.param:
        extension.set_max_isa(ISAS[0])
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    extension.set_max_isa(ISAS[0])


@pytest.mark.parametrize("digits", [1, 2])  # w8a8/w4a8, and int8/int4's two digits
@pytest.mark.parametrize("scales", [torch.float32, torch.float16])  # weights from float, or GGUF's blocks
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 8, 13, 40])
def test_kernel_matches_the_quantized_numbers_and_the_float_reference(bits, rows, scales, digits, isa):
    gen = torch.Generator().manual_seed(rows)
    out = 75 if rows % 2 else 72  # a last group of 3 weight rows, or whole groups of 8
    weight = torch.randn(out, 160, generator=gen) if scales == torch.float32 else \
        _gguf_blocks("q4_1" if bits == 4 else "q8_0", out, 160)
    bias = torch.randn(out, generator=gen)
    cls = qact.BlockQ8Linear if digits == 1 else qact.TwoDigitLinear
    layer = cls(weight, bias, bits, qact.QACT)
    assert layer.packed_scales.dtype == scales
    fallback = cls(weight, bias, bits, qact.TORCH_Q8)
    assert torch.equal(layer.dequantized(), fallback.dequantized())
    x = torch.randn(2, rows, 160, generator=gen) * torch.logspace(-2, 1, 160)  # uneven blocks, leading dims kept
    got = layer(x)
    assert got.shape == (2, rows, out)
    assert rel(got, fallback(x)) <= SAME_NUMBERS_TOL
    assert rel(got, F.linear(x, layer.dequantized(), bias)) <= (FLOAT_TOL if digits == 1 else FLOAT_TOL_2)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("digits", [1, 2])
def test_activation_codes_are_the_reference_codes_on_every_path(digits, isa):
    """The vectorised activation quantization makes exactly fake_quantize_blocks'
    codes and steps (one digit: a step per half block of 16; two: one per block
    of 32, stored for both halves): halves round to even, zero blocks stay zero,
    the remainder's product is not fused."""
    gen = torch.Generator().manual_seed(digits)
    x = torch.randn(5, 192, generator=gen) * torch.logspace(-3, 2, 192)
    x[0, :32] = torch.arange(32) - 15.5  # exact halves, once d = 1:
    x[0, 0] = x[0, 16] = 127.0
    x[1, 32:64] = 0.0  # a zero block: d = 0, codes 0
    x[2, 64:80] = 0.0  # a zero half next to a live one
    codes, d, sums = torch.ops.ferrum_qact.quantize(x, digits)
    assert codes.shape == (5, digits, 192) and codes.dtype == torch.int8
    assert d.shape == (5, 12) and sums.shape == (5, 6)
    width = 16 if digits == 1 else 32
    blocks = x.unflatten(-1, (-1, width))
    want_d = blocks.abs().amax(-1) / 127
    inv = torch.where(want_d > 0, 1 / want_d, 0.0)[..., None]
    q = (blocks * inv).round()
    assert torch.equal(d, want_d if digits == 1 else want_d.repeat_interleave(2, dim=-1))
    assert torch.equal(codes[:, 0].float(), q.flatten(-2))
    assert codes[0, 0, 1].item() == -14 and codes[0, 0, 2].item() == -14  # -14.5 and -13.5: to even
    total = (want_d * q.sum(-1)).unflatten(-1, (6, -1)).sum(-1)
    if digits == 2:
        rest = ((blocks - q * want_d[..., None]) * inv * 128).round().clamp(-127, 127)
        assert torch.equal(codes[:, 1].float(), rest.flatten(-2))
        total = total + want_d / 128 * rest.sum(-1)
    torch.testing.assert_close(sums, total, rtol=1e-6, atol=1e-6)
    assert not codes[1, :, 32:64].any() and (d[1, 2:4] == 0).all()
    if digits == 1:
        assert d[2, 4] == 0 and d[2, 5] > 0 and not codes[2, 0, 64:80].any() and codes[2, 0, 80:96].abs().max() == 127


def test_rotation_is_the_order_16_hadamard_and_its_own_inverse():
    h4 = torch.ones(4, 4, dtype=torch.float64) - 2 * torch.eye(4, dtype=torch.float64)
    h16 = torch.kron(h4, h4) / 4
    assert torch.equal(h16, h16.T) and torch.equal(h16 @ h16, torch.eye(16, dtype=torch.float64))
    assert torch.equal(h16.sum(0), torch.ones(16, dtype=torch.float64))  # rows sum to 1: minimums stay minimums
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    want = (x.double().unflatten(-1, (-1, 16)) @ h16).flatten(-2)
    assert (qact.rotate16(x).double() - want).abs().max().item() <= 1e-6
    assert (qact.rotate16(qact.rotate16(x)) - x).abs().max().item() <= 1e-6
    spike = torch.zeros(1, 16)
    spike[0, 3] = 100.0  # an outlier is spread over its 16 elements
    assert torch.equal(qact.rotate16(spike).abs(), torch.full((1, 16), 25.0))


def test_rotated_activation_codes_are_the_codes_of_the_rotated_floats_on_every_path(isa):
    """csrc/qact.cpp rotates before it quantizes, in rotate16's order: the same floats,
    so every path's codes are those of ``rotate16(x)``, and one digit only."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(5, 192, generator=gen) * torch.logspace(-3, 2, 192)
    x[1, 40] = 1e4  # an outlier channel
    got = torch.ops.ferrum_qact.quantize(x, 1, True)
    want = torch.ops.ferrum_qact.quantize(qact.rotate16(x), 1, False)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    with pytest.raises(RuntimeError, match="one digit"):
        torch.ops.ferrum_qact.quantize(x, 2, True)


def test_w8a8_rotates_gguf_q4_1_blocks_without_loss_and_float_weights_not_at_all():
    weight = _gguf_blocks("q4_1", 48, 128)
    layer = qact.RotatedQ8Linear(weight, None, 8, qact.QACT)
    assert layer.rotated
    h4 = torch.ones(4, 4, dtype=torch.float64) - 2 * torch.eye(4, dtype=torch.float64)
    exact = (weight.double().unflatten(-1, (-1, 16)) @ (torch.kron(h4, h4) / 4)).flatten(-2)
    top = weight.abs().max().item()
    assert (layer.held().double() - exact).abs().max().item() <= 1e-6 * top  # the rotated weights, exactly
    assert (layer.dequantized() - weight).abs().max().item() <= 1e-6 * top  # and back
    codes = qact.unpack_rows(layer.packed, layer.packed_scales, 8, 48)[0]
    assert int(codes.max()) <= 240  # 16 codes of 0..15 times H: a span of 240 at most
    from_float = qact.RotatedQ8Linear(torch.randn(48, 128, generator=torch.Generator().manual_seed(1)), None, 8,
                                      qact.QACT)
    assert not from_float.rotated  # 256 levels a block rotate past 8 bits: left as BlockQ8Linear
    assert qact.rotate_codes(torch.full((2, 32), 7, dtype=torch.uint8), torch.ones(2, 1), torch.zeros(2, 1))[0] \
        .eq(0).all()  # a constant block: codes 0, the value in the minimum


@pytest.mark.parametrize("rows", [1, 3, 8, 13, 40])
def test_rotated_kernel_matches_the_fallback_and_beats_the_unrotated_grid(rows, isa):
    """Against activations with outlier channels (SmolLM2's shape of trouble), the
    rotated layer's error against the float product is a fraction of the unrotated
    one's, and the kernel gives the fallback's numbers on every path."""
    gen = torch.Generator().manual_seed(rows)
    weight = _gguf_blocks("q4_1", 72, 160)
    x = torch.randn(rows, 160, generator=gen)
    x[:, [3, 50, 97, 130]] *= 60.0  # one outlier channel in each of four blocks
    want = F.linear(x, weight)
    rotated = qact.RotatedQ8Linear(weight, None, 8, qact.QACT)
    plain = qact.BlockQ8Linear(weight, None, 8, qact.QACT)
    assert rotated.rotated
    assert rel(rotated(x), qact.RotatedQ8Linear(weight, None, 8, qact.TORCH_Q8)(x)) <= SAME_NUMBERS_TOL
    err_rotated, err_plain = rel(rotated(x), want), rel(plain(x), want)
    assert err_rotated <= FLOAT_TOL and err_rotated < 0.5 * err_plain


def test_block_linear_refuses_two_rotated_digits(extension):
    layer = qact.RotatedQ8Linear(_gguf_blocks("q4_1", 16, 64), None, 8, qact.QACT)
    with pytest.raises(RuntimeError, match="one digit"):
        extension.block_linear(torch.randn(1, 64), layer.packed, layer.packed_scales, 8, 16, 2, True)


def test_w8a8_layers_rotate_and_its_lm_head_takes_two_digits(tiny_q4_llama_dir, tiny_llama_dir):
    from ferrum_rpc.server.engine.executor import TorchExecutor

    ex = TorchExecutor.from_path("q4", tiny_q4_llama_dir, ExecutorConfig(quantize="w8a8", kv_tokens=64))
    layers = [m for m in ex.model.modules() if isinstance(m, qact.BlockQ8Linear)]
    assert type(ex.model.lm_head) is qact.TwoDigitLinear
    projections = [m for m in layers if m is not ex.model.lm_head]
    assert len(projections) == 8 and all(type(m) is qact.RotatedQ8Linear and m.rotated for m in projections)
    assert "activations rotated (rotate16) on 8 of 8 projections, LM head on two digits" in ex.model.kernels.reason
    floats = TorchExecutor.from_path("f", tiny_llama_dir, ExecutorConfig(quantize="w8a8", kv_tokens=64))
    assert "rotated (rotate16) on 0 of 8" in floats.model.kernels.reason


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layout_round_trips(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (21, 96), generator=gen, dtype=torch.uint8)
    scales, mins = torch.rand(21, 3, generator=gen), torch.randn(21, 3, generator=gen)
    packed, packed_scales = qact.pack_rows(codes, scales, mins, bits)
    assert packed.shape == (2, 3, 64 * bits) and packed_scales.shape == (2, 3, 2, 16)  # units of 16 rows
    words = packed.view(2, 3, -1, 2, 8, 4)  # unit, block, word, group of the unit, row, byte
    assert words[1, :, :, 0, 5:].eq(0).all() and words[1, :, :, 1].eq(0).all()  # rows 21..31 pad with zeros
    back = qact.unpack_rows(packed, packed_scales, bits, 21)
    assert torch.equal(back[0], codes)
    assert torch.equal(back[1], scales.half().float()) and torch.equal(back[2], mins.half().float())
    if bits == 8:  # row r's codes 4k..4k+3 sit in 32-bit lane r % 8 of word k of its group
        assert words[0, 0, 2, 0, 5].tolist() == codes[5, 8:12].tolist()
        assert words[1, 1, 3, 0, 4].tolist() == codes[20, 32 + 12:32 + 16].tolist()


def test_int8_codes_at_both_ends_do_not_saturate(extension):
    """Codes -128 and 127 against activations of +-127 in every lane: vpdpbusd
    takes the unsigned codes, and so does AVX2's vpmaddwd over int16 activations
    (qact_tile.inc tile_wide: 2 * 255 * 127 per int32 pair, far inside)."""
    weight = torch.tensor([[-128.0] * 16 + [127.0] * 16, [127.0] * 32]).repeat(4, 3)  # (8, 96)
    layer = qact.BlockQ8Linear(weight, None, 8, qact.QACT)
    assert (layer.dequantized() == weight).all()  # the symmetric grid holds these exactly
    ran = set()
    for x in (torch.full((1, 96), -1.0), torch.full((1, 96), 1.0), torch.tensor([[1.0] * 16 + [-1.0] * 16] * 3).view(1, 96)):
        for isa in ISAS:
            ran.add(extension.set_max_isa(isa))
            assert rel(layer(x), x @ weight.T) <= 1e-6, isa
    extension.set_max_isa(ISAS[0])
    assert {"avx2", "portable"} <= ran


def test_threaded_under_inference_mode(extension):
    gen = torch.Generator().manual_seed(3)
    layer = qact.BlockQ8Linear(torch.randn(1100, 96, generator=gen), None, 4, qact.QACT)
    x = torch.randn(33, 96, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            got = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert rel(got, qact.BlockQ8Linear(layer.dequantized(), None, 4, qact.TORCH_Q8)(x)) <= SAME_NUMBERS_TOL


def test_w4a8_holds_gguf_q4_1_blocks_without_further_loss():
    weight = _gguf_blocks("q4_1", 48, 128)
    layer = qact.BlockQ8Linear(weight, None, 4, qact.QACT)
    assert (layer.dequantized() - weight).abs().max().item() <= 1e-6 * weight.abs().max().item()
    # 4-bit codes and float16 scale and minimum per 32 weights: 5 bits a weight (the int4 mode: 6)
    assert layer.nbytes == weight.numel() * (0.5 + 4 / 32)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_row_does_not_depend_on_the_rows_beside_it(bits, extension):
    """Activations are quantized per block of a row, never over the batch: a row
    with small values keeps its precision next to a row a thousand times larger."""
    gen = torch.Generator().manual_seed(5)
    layer = qact.BlockQ8Linear(torch.randn(64, 128, generator=gen), None, bits, qact.QACT)
    small, large = torch.randn(2, 128, generator=gen), 1000 * torch.randn(5, 128, generator=gen)
    alone, beside = layer(small), layer(torch.cat([small, large]))[:2]
    assert torch.allclose(alone, beside, rtol=1e-5, atol=1e-5 * alone.abs().max().item())


@pytest.mark.parametrize("cls", [qact.BlockQ8Linear, qact.TwoDigitLinear, qact.RotatedQ8Linear])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_rows_bits_do_not_depend_on_the_row_count(cls, bits, isa):
    """--batch-invariant's quantized linear: a row's outputs are bit-identical alone, in
    any place of the tiles of 8, 4 and the rest, and on one or two threads."""
    gen = torch.Generator().manual_seed(bits)
    weight = woq.QuantizedLinear(torch.randn(75, 96, generator=gen), None, 4, woq.DEQUANT).dequantized()
    layer = cls(weight, None, bits, qact.QACT)  # Q4_1's grid: the 8-bit rotated layer rotates
    assert layer.rotated == (cls is qact.RotatedQ8Linear and bits == 8)
    x = torch.randn(21, 96, generator=gen) * torch.logspace(-2, 1, 96)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = layer(x)
        torch.set_num_threads(2)
        full = layer(x)
        assert torch.equal(full, one_thread)
        for m in range(len(x)):
            assert torch.equal(layer(x[m:m + 1]), full[m:m + 1]), m
        assert torch.equal(layer(x[3:16]), full[3:16]) and torch.equal(layer(x[5:]), full[5:])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("cls,bits,scales", [
    (cls, bits, scales) for cls, bits in [(qact.TwoDigitLinear, 8), (qact.TwoDigitLinear, 4), (qact.BlockQ8Linear, 8)]
    for scales in (torch.float32, torch.float16)] + [(qact.RotatedQ8Linear, 8, torch.float32)])  # Q4_1's grid rotates
def test_avx2_wide_loops_give_the_vnni_loops_bits(cls, bits, scales, extension):
    """AVX2 runs two digits and 8-bit codes on int16 activations (vpmaddwd, qact_tile.inc
    tile_wide): the VNNI loops' integer sums and float steps, so their bits, at every
    row count: the few-row tiles widen the codes in registers, past 4 rows once per
    group for all rows."""
    if extension.set_max_isa("avx2") != "avx2":
        pytest.skip("this CPU cannot run the avx2 path")
    gen = torch.Generator().manual_seed(bits)
    weight = _gguf_blocks("q4_1" if bits == 4 else "q8_0", 75, 160) if scales == torch.float16 else \
        woq.QuantizedLinear(torch.randn(75, 160, generator=gen), None, 4, woq.DEQUANT).dequantized()
    layer = cls(weight, None, bits, qact.QACT)
    assert layer.packed_scales.dtype == scales and layer.rotated == (cls is qact.RotatedQ8Linear)
    x = torch.randn(40, 160, generator=gen) * torch.logspace(-2, 1, 160)
    vnni = [isa for isa in ("avx512-vnni", "avx-vnni") if extension.set_max_isa(isa) == isa]
    if not vnni:
        extension.set_max_isa(ISAS[0])
        pytest.skip("this CPU has no VNNI loops to compare with")
    try:
        want = {isa: (extension.set_max_isa(isa), [layer(x[:r]) for r in (1, 3, 4, 5, 13, 40)])[1] for isa in vnni}
        extension.set_max_isa("avx2")
        got = [layer(x[:r]) for r in (1, 3, 4, 5, 13, 40)]
    finally:
        extension.set_max_isa(ISAS[0])
    for isa in vnni:
        for g, w in zip(got, want[isa]):
            assert torch.equal(g, w), (isa, len(g))


def test_choice_and_fallbacks(extension):
    kernel, why = qact.choose_kernel("auto")
    assert kernel == qact.QACT and why.startswith("built and probed OK")
    assert qact.choose_kernel("aten") == (qact.TORCH_Q8, "forced by configuration")
    with pytest.raises(ValueError, match="quantize must be"):
        ExecutorConfig(quantize="w2a8")
    with pytest.raises(ValueError, match="CPU path"):
        ExecutorConfig(quantize="w4a8", device="cuda")


@pytest.mark.parametrize("quantize", ["int8", "w4a8"])
def test_batch_invariant_quantized_models_run_every_linear_on_block_linear(quantize, tiny_llama_dir, extension,
                                                                         monkeypatch):
    """int8/int4 too (not woq.py's float-activation kernels), whatever --linear-kernel asks;
    the whole-layer op for any row count; refused at load where qact.cpp cannot run."""
    for linear in ("auto", "aten"):
        model = load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), linear_kernel=linear,
                           quantize=quantize, batch_invariant=True)
        layers = [m for m in model.modules() if isinstance(m, woq.QuantizedLinear)]
        assert layers and all(m.kernel == qact.QACT and isinstance(m, qact.BlockQ8Linear) for m in layers)
        assert model.batch_invariant and model.kernels.linear == f"{quantize} {qact.QACT}"
        assert model.layer_ops is not None and model.layer_ops_rows is None
    monkeypatch.setattr(qact, "probe", lambda: (False, "not in this test"))
    with pytest.raises(StartupError, match=f"--batch-invariant --quantize {quantize} needs.*not in this test"):
        load_model(tiny_llama_dir, torch.float32, torch.device("cpu"), quantize=quantize, batch_invariant=True)


# Logits of a tiny random model through gRPC against transformers on our (dequantized)
# weights, whose activations stay float: the activation grid is the difference.
MODEL_TOL = 0.03


@pytest.mark.parametrize("kernel", ["auto", "aten"])  # the fast kernel, and the torch fallback
@pytest.mark.parametrize("quantize", ["w8a8", "w4a8"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "llama-q4"])  # llama-q4: Q4_1-grid weights, w8a8 rotates
def test_model_matches_transformers_on_the_same_weights(arch, quantize, kernel, tiny_llama_dir, tiny_qwen3_dir,
                                                        tiny_q4_llama_dir):
    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "llama-q4": tiny_q4_llama_dir}[arch]
    arch = arch.removesuffix("-q4")
    oracle = _oracle_with_our_weights(model_dir, arch, quantize)
    logits = lambda ids: oracle(torch.tensor([ids])).logits[0].detach().numpy()  # noqa: E731
    prompts = [[5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 64, 2, 77], [8, 1, 99], list(range(20, 47))]
    with running_server(model_dir, quantize=quantize, linear_kernel=kernel, prefill_chunk=8) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        caps = ex.capabilities()
        assert caps.quantization == quantize
        expected = qact.QACT if kernel == "auto" else qact.TORCH_Q8
        assert caps.kernel_path.startswith(f"linear={quantize} {expected}")
        if quantize == "w8a8":
            assert f"rotated (rotate16) on {8 if model_dir == tiny_q4_llama_dir else 0} of 8" in caps.kernel_path
        outs = [ex.prefill(p, logits=LogitsPolicy.full(all_positions=True)) for p in prompts]
        for out, prompt in zip(outs, prompts):
            want = logits(prompt)
            assert np.abs(out.logits.values - want).max() <= MODEL_TOL * np.abs(want).max()
        ids, handles = [list(p) for p in prompts], [o.kv_cache for o in outs]
        for _ in range(3):  # batched decode of mixed lengths (the one-row and batch paths)
            tokens = [int(logits(i)[-1].argmax()) for i in ids]
            steps = ex.batch_decode(list(zip(tokens, handles)), LogitsPolicy.full())
            for step, seq, token in zip(steps, ids, tokens):
                seq.append(token)
                want = logits(seq)[-1]
                assert np.abs(step.logits.values[0] - want).max() <= MODEL_TOL * np.abs(want).max()
            handles = [s.kv_cache for s in steps]
        single = ex.decode(3, handles[1], LogitsPolicy.full())
        want = logits(ids[1] + [3])[-1]
        assert np.abs(single.logits.values[0] - want).max() <= MODEL_TOL * np.abs(want).max()
