"""The executor on a CUDA device, through real gRPC: weights and the KV pool on the GPU,
parity with transformers (float32 with TF32 off; bfloat16 within a stated tolerance),
token choice on the device, and what GetCapabilities says of batch invariance there.

These run only where torch sees a CUDA device (the GPU machine); the rest of the
contract's tests run there too with ``FERRUM_TEST_DEVICE=cuda``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.types import TokenChoice
from tests.conftest import hf_oracle, oracle_rows, running_server

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ATOL = 1e-4
PROMPT = [5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 64, 2, 77]


@pytest.fixture(scope="module", autouse=True)
def full_float32_matmuls():
    """float32 parity is held at 1e-4 with TF32 off (torch's default; set here so that a
    machine's own setting cannot loosen it)."""
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_float32_prompt_and_greedy_steps_match_transformers(arch, tiny_llama_dir, tiny_qwen3_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    oracle = hf_oracle(model_dir, arch)
    with running_server(model_dir, device="cuda") as server, ExecutorClient(server.target, timeout=60) as ex:
        assert ex.info().device.startswith("cuda")
        out = ex.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True))
        assert out.kv_cache.device.startswith("cuda")
        np.testing.assert_allclose(out.logits.values, oracle_rows(oracle, PROMPT), atol=ATOL, rtol=0)
        ids, handle = list(PROMPT), out.kv_cache
        for _ in range(12):
            ref = oracle_rows(oracle, ids)[-1]
            ids.append(int(ref.argmax()))
            step = ex.decode(ids[-1], handle)
            handle = step.kv_cache
            np.testing.assert_allclose(step.logits.values[0], oracle_rows(oracle, ids)[-1], atol=ATOL, rtol=0)
        ex.release_cache(handle)


def test_bfloat16_stays_close_to_float32_transformers(tiny_llama_dir):
    """bfloat16 weights and KV: within 3% of the float32 oracle's largest logit, as on the CPU."""
    oracle = hf_oracle(tiny_llama_dir, "llama")
    ref = oracle_rows(oracle, PROMPT + [11])
    with running_server(tiny_llama_dir, device="cuda", dtype="bfloat16") as server, \
            ExecutorClient(server.target, timeout=60) as ex:
        assert (ex.info().dtype, ex.info().kv_dtype) == ("bfloat16", "bfloat16")
        out = ex.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True))
        steps = ex.batch_decode([(11, out.kv_cache), (11, ex.prefill(PROMPT).kv_cache)])
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out.logits.values, ref[:-1], atol=0.03 * scale, rtol=0)
    for s in steps:
        np.testing.assert_allclose(s.logits.values[0], ref[-1], atol=0.03 * scale, rtol=0)


def test_weights_and_pool_live_on_the_device_and_capabilities_say_so(tiny_llama_dir):
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    ex = TorchExecutor.from_path("tiny", str(tiny_llama_dir), ExecutorConfig(device="cuda", kv_tokens=256))
    assert {p.device.type for p in ex.model.parameters()} == {"cuda"}
    assert (ex.pool.k.device.type, ex.pool.v.device.type) == ("cuda", "cuda")
    with running_server(tiny_llama_dir, device="cuda") as server, ExecutorClient(server.target, timeout=60) as client:
        caps = client.capabilities()
        assert "cuda" in caps.supported_devices
        assert not caps.batch_invariant  # the CPU kernels hold it; cuBLAS picks its tiling by shape
        assert "device is cuda" in caps.kernel_path


def test_token_choice_runs_on_the_device(tiny_llama_dir):
    """Greedy choice is the float32 row's argmax; a seed gives the same tokens twice."""
    with running_server(tiny_llama_dir, device="cuda") as server, ExecutorClient(server.target, timeout=60) as ex:
        full = ex.prefill(PROMPT)
        greedy = ex.prefill(PROMPT, token_choice=TokenChoice.greedy())
        assert greedy.chosen.token_id == int(full.logits.values[0].argmax())
        seeded = TokenChoice(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
        runs = []
        for _ in range(2):
            out = ex.prefill(PROMPT, token_choice=seeded)
            tokens, handle = [out.chosen.token_id], out.kv_cache
            for _ in range(8):
                out = ex.decode(tokens[-1], handle, token_choice=seeded)
                tokens.append(out.chosen.token_id)
                handle = out.kv_cache
            ex.release_cache(handle)
            runs.append(tokens)
        assert runs[0] == runs[1]
        ex.release_cache(full.kv_cache)
        ex.release_cache(greedy.kv_cache)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_replayed_as_cuda_graphs_equal_eager_steps(dtype, tiny_llama_dir):
    """Batches of 1-3 sequences growing past several block-table widths: each graph-replayed
    step's logits equal the eager step's (float32 at 1e-4; bfloat16 within 1% of the largest
    logit, the two paths' kernels rounding differently), and the greedy run decoding ahead
    chooses the same tokens."""
    prompts = [PROMPT, PROMPT[:3], PROMPT[2:] + PROMPT]
    with running_server(tiny_llama_dir, device="cuda", dtype=dtype) as graphs, \
            running_server(tiny_llama_dir, device="cuda", dtype=dtype, cuda_graphs="off") as eager, \
            ExecutorClient(graphs.target, timeout=60) as a, ExecutorClient(eager.target, timeout=60) as b:
        assert "decode=cuda-graphs" in a.capabilities().kernel_path
        assert "decode=cuda-graphs" not in b.capabilities().kernel_path
        ha = [a.prefill(p).kv_cache for p in prompts]
        hb = [b.prefill(p).kv_cache for p in prompts]
        tokens = [7, 8, 9]
        for step in range(24):
            live = [0, 1, 2][: 1 + step % 3]
            out_a = a.batch_decode([(tokens[i], ha[i]) for i in live])
            out_b = b.batch_decode([(tokens[i], hb[i]) for i in live])
            for i, x, y in zip(live, out_a, out_b):
                scale = np.abs(y.logits.values).max()
                np.testing.assert_allclose(x.logits.values, y.logits.values, rtol=0,
                                           atol=ATOL if dtype == "float32" else 0.01 * scale)
                ha[i], hb[i], tokens[i] = x.kv_cache, y.kv_cache, int(y.logits.values[0].argmax())
        executor = graphs.app.servicer.gate.workers["tiny"].executor
        # (the server's warm-up measured every batch bucket through graphs too)
        assert {1, 2, 4} <= {batch for batch, _ in executor.graphs.graphs}
        assert len({width for _, width in executor.graphs.graphs}) >= 2
        if dtype == "float32":
            runs = [c.decode_ahead(5, h[0], TokenChoice.greedy(), 16).chosen for c, h in ((a, ha), (b, hb))]
            assert [t.token_id for t in runs[0]] == [t.token_id for t in runs[1]]
