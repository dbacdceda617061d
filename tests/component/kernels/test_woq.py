"""Weight-only int8/int4 (``--quantize``): kernels against the reference on both
inner-loop paths, the GGUF block layouts held without loss, and whole-model
parity with transformers running the same (dequantized) weights, through gRPC."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.server.kernels import qact
from ferrum_rpc.server.kernels import woq
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from tests.conftest import TINY, running_server

ATOL = 1e-4


@pytest.fixture(scope="module")
def extension():
    ok, why = woq.probe_woq()
    assert ok, f"the int8/int4 extension should build and agree on this machine: {why}"
    return torch.ops.ferrum_woq


@pytest.fixture(params=["avx512", "avx2", "portable"])
def isa(request, extension):
    """Runs a test on each inner-loop build this CPU can run (AVX-512 and AVX2 only where it has them)."""
    ran = extension.set_max_isa(request.param)
    if ran != request.param:
        extension.set_max_isa("avx512")
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    extension.set_max_isa("avx512")


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 12, 13, 40])
def test_kernel_matches_the_dequantized_reference(bits, rows, isa):
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(72, 160, generator=gen), torch.randn(72, generator=gen)
    layer = woq.QuantizedLinear(weight, bias, bits, woq.WOQ)
    fallback = woq.QuantizedLinear(weight, bias, bits, woq.DEQUANT)
    x = torch.randn(2, rows, 160, generator=gen)  # leading dims are kept
    want = F.linear(x, layer.dequantized(), bias)
    np.testing.assert_allclose(layer(x).numpy(), want.numpy(), atol=ATOL, rtol=0)
    np.testing.assert_allclose(fallback(x).numpy(), want.numpy(), atol=ATOL, rtol=0)
    assert layer(x.bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("rows", [1, 40])
def test_kernels_run_threaded_and_under_inference_mode(bits, rows, isa):
    """Enough weight rows for several threads and GEMM tiles, called as the
    executor calls them (inference mode is thread-local: the kernels' OpenMP
    workers once refused to write the output of an inference-mode call)."""
    gen = torch.Generator().manual_seed(7)
    weight = torch.randn(1100, 96, generator=gen)
    layer = woq.QuantizedLinear(weight, None, bits, woq.WOQ)
    x = torch.randn(rows, 96, generator=gen)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with torch.inference_mode():
            got = layer(x)
    finally:
        torch.set_num_threads(threads)
    np.testing.assert_allclose(got.numpy(), F.linear(x, layer.dequantized()).numpy(), atol=ATOL, rtol=0)


@pytest.mark.parametrize("bits,tolerance", [(8, 0.01), (4, 0.15)])
def test_quantization_error_is_bounded(bits, tolerance):
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    layer = woq.QuantizedLinear(weight, None, bits, woq.DEQUANT)
    err = (layer.dequantized() - weight).abs().max() / weight.abs().max()
    assert err < tolerance
    # a float32 scale and minimum per 32 weights: int8 1.25 bytes a weight, int4 0.75
    assert layer.nbytes == weight.numel() * (1.25 if bits == 8 else 0.75)


def _gguf_blocks(kind: str, n: int, k: int) -> torch.Tensor:
    """Float32 weights exactly as GGUF's Q4_1 / Q8_0 dequantizers produce them (fp16 scales)."""
    gen = torch.Generator().manual_seed(7)
    groups = k // woq.GROUP
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, groups, woq.GROUP), generator=gen)
        q[..., 0], q[..., 1] = 0, 15  # the quantizer maps each block's min to 0 and max to 15
        d = (torch.rand(n, groups, 1, generator=gen) * 0.01 + 1e-4).half().float()  # GGUF keeps d in float16
        m = (torch.randn(n, groups, 1, generator=gen) * 0.05).half().float()
        return (q.float() * d + m).view(n, k)
    q = torch.randint(-127, 128, (n, groups, woq.GROUP), generator=gen)
    q[..., 0] = 127  # Q8_0: scale = amax / 127
    d = (torch.rand(n, groups, 1, generator=gen) * 0.01 + 1e-4).half().float()
    return (q.float() * d).view(n, k)


@pytest.mark.parametrize("kind,bits", [("q4_1", 4), ("q4_1", 8), ("q8_0", 8)])
def test_gguf_blocks_are_held_without_further_loss(kind, bits):
    weight = _gguf_blocks(kind, 48, 128)
    layer = woq.QuantizedLinear(weight, None, bits, woq.DEQUANT)
    err = (layer.dequantized() - weight).abs().max().item()
    assert err <= 1e-6 * weight.abs().max().item()  # float32 rounding only: every code came back


def _oracle_with_our_weights(model_dir, arch: str, quantize: str):
    """transformers' model with every linear weight replaced by the one our quantized layer computes with."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM

    classes = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}
    oracle = classes[arch].from_pretrained(model_dir, dtype=torch.float32).eval()
    ours = TorchExecutor.from_path("x", model_dir, ExecutorConfig(quantize=quantize, kv_tokens=64)).model
    hf = dict(oracle.named_modules())
    replaced = 0
    for name, module in ours.named_modules():
        if not callable(getattr(module, "dequantized", None)):  # every quantized layer type (qact.py too)
            continue
        weight = module.dequantized()
        prefix, _, leaf = name.rpartition(".")
        if leaf == "qkv_proj":
            cfg = ours.config
            q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
            parts = dict(zip(("q_proj", "k_proj", "v_proj"), weight.split([q_dim, kv_dim, kv_dim])))
        elif leaf == "gate_up_proj":
            parts = dict(zip(("gate_proj", "up_proj"), weight.chunk(2)))
        else:
            parts = {leaf: weight}
        for part, w in parts.items():
            target = hf[f"{prefix}.{part}" if prefix else part]
            target.weight = torch.nn.Parameter(w.clone(), requires_grad=False)  # unties a tied head
            replaced += 1
    assert replaced >= 5
    return oracle


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(**TINY, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    path = tmp_path_factory.mktemp("tiny-moe-woq")
    Qwen3MoeForCausalLM(cfg).eval().save_pretrained(path)
    return path


# auto: the integer kernel with two activation digits (qact.py); woq: where that kernel cannot
# run, csrc/woq.cpp on float activations; aten: torch's ops on the dequantized weights.
@pytest.mark.parametrize("kernel", ["auto", "woq", "aten"])
@pytest.mark.parametrize("quantize", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_quantized_model_matches_transformers_on_the_same_weights(arch, quantize, kernel, tiny_llama_dir,
                                                                   tiny_qwen3_dir, tiny_moe_dir, monkeypatch):
    model_dir = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "qwen3_moe": tiny_moe_dir}[arch]
    if kernel == "woq":
        monkeypatch.setattr(qact, "choose_kernel", lambda requested: (qact.TORCH_Q8, "fallback: not in this test"))
    oracle = _oracle_with_our_weights(model_dir, arch, quantize)
    logits = lambda ids: oracle(torch.tensor([ids])).logits[0].detach().numpy()  # noqa: E731
    prompts = [[5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 64, 2, 77], [8, 1, 99], list(range(20, 47))]
    with running_server(model_dir, quantize=quantize, linear_kernel="aten" if kernel == "aten" else "auto",
                        prefill_chunk=8) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        caps = ex.capabilities()
        assert caps.quantization == quantize
        expected_kernel = {"auto": qact.QACT, "woq": woq.WOQ, "aten": woq.DEQUANT}[kernel]
        assert caps.kernel_path.startswith(f"linear={quantize} {expected_kernel}")
        assert ("activations as two int8 digits" in caps.kernel_path) == (kernel == "auto")
        assert ("float activations (integer kernel: fallback: not in this test)" in caps.kernel_path) == \
            (kernel == "woq")
        outs = [ex.prefill(p, logits=LogitsPolicy.full(all_positions=True)) for p in prompts]  # chunked: > 8
        for out, prompt in zip(outs, prompts):
            np.testing.assert_allclose(out.logits.values, logits(prompt), atol=ATOL, rtol=0)
        # batched decode of mixed lengths, then a forward_verify over the first sequence
        ids = [list(p) for p in prompts]
        handles = [o.kv_cache for o in outs]
        for _ in range(4):
            tokens = [int(logits(i)[-1].argmax()) for i in ids]
            steps = ex.batch_decode(list(zip(tokens, handles)), LogitsPolicy.full())
            for step, seq, token in zip(steps, ids, tokens):
                seq.append(token)
                np.testing.assert_allclose(step.logits.values[0], logits(seq)[-1], atol=ATOL, rtol=0)
            handles = [s.kv_cache for s in steps]
        draft = [3, 4, 5]
        verify = ex.forward_verify(draft, handles[0], LogitsPolicy.full())
        np.testing.assert_allclose(verify.logits.values, logits(ids[0] + draft)[-3:], atol=ATOL, rtol=0)
        for h in handles[1:] + [verify.kv_cache]:
            ex.release_cache(h)


def test_quantize_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="CPU path"):
        ExecutorConfig(quantize="int4", device="cuda")
    with pytest.raises(ValueError, match="oneDNN"):
        ExecutorConfig(quantize="int8", linear_kernel="onednn-packed")
    with pytest.raises(ValueError, match="quantize must be"):
        ExecutorConfig(quantize="int2")
