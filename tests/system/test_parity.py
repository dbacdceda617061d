"""Parity with transformers (the independent oracle) through real gRPC, float32."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from tests.conftest import hf_oracle, oracle_rows, running_server

ATOL = 1e-4


# auto: batch-invariant where the fused ops run (the panel GEMM), else whatever the probe
# picks; per-shape: the probe's pick with batch invariance off; aten: the forced fallback
KERNELS = ["auto", "per-shape", "aten"]


def _kernels(kernel: str, step: str) -> dict:
    return dict(linear_kernel="aten" if kernel == "aten" else "auto", step_ops=step,
                batch_invariant="off" if kernel == "per-shape" else "auto")


FUSED = pytest.param("fused", marks=pytest.mark.cpu_only)


@pytest.mark.parametrize("step", [FUSED, "eager"])  # the fused step ops (fused.py) and their fallback
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_prefill_and_16_greedy_steps_match_transformers(arch, kernel, step, tiny_llama_dir, tiny_qwen3_dir):
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    oracle = hf_oracle(model_dir, arch)
    prompt = [5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 64, 2, 77]
    with running_server(model_dir, **_kernels(kernel, step)) as server, ExecutorClient(server.target, timeout=30) as ex:
        caps = ex.capabilities()
        kernel_path = caps.kernel_path
        assert f"step={step}" in kernel_path
        if kernel == "aten":
            assert kernel_path.startswith("linear=aten")
        invariant = kernel == "auto" and step == "fused"
        assert caps.batch_invariant == invariant
        assert kernel_path.startswith("linear=panel_gemm (batch-invariant") == invariant
        # without it, float32 decodes (one row) run on linear_rows.cpp's linear_rows exactly where the fused ops do
        assert ("1-4 rows: linear_rows" in kernel_path) == (kernel == "per-shape" and step == "fused")
        out = ex.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
        ref = oracle_rows(oracle, prompt)
        assert out.logits.values.shape == ref.shape
        np.testing.assert_allclose(out.logits.values, ref, atol=ATOL, rtol=0)

        ids, handle = list(prompt), out.kv_cache
        token = int(ref[-1].argmax())
        for _ in range(16):
            ids.append(token)
            step = ex.decode(token, handle)
            handle = step.kv_cache
            ref_row = oracle_rows(oracle, ids)[-1]
            np.testing.assert_allclose(step.logits.values[0], ref_row, atol=ATOL, rtol=0)
            token = int(ref_row.argmax())
            assert step.logits.argmax()[0] == token
        assert handle.sequence_length == len(prompt) + 16
        ex.release_cache(handle)


def test_batch_decode_of_different_lengths_equals_decoding_alone(client):
    prompts = [[1, 2, 3], list(range(10, 21)), [7], list(range(40, 70)), [300, 200, 100, 5, 6]]
    next_tokens = [11, 22, 33, 44, 55]
    alone = []
    for prompt, token in zip(prompts, next_tokens):
        step = client.decode(token, client.prefill(prompt).kv_cache)
        alone.append(step.logits.values[0])
        client.release_cache(step.kv_cache)

    handles = [client.prefill(p).kv_cache for p in prompts]
    outs = client.batch_decode(list(zip(next_tokens, handles)))
    assert [o.kv_cache.cache_id for o in outs] == [h.cache_id for h in handles]
    for out, ref, prompt in zip(outs, alone, prompts):
        assert out.timing.batch_size == len(prompts)  # one forward served them all
        assert out.kv_cache.sequence_length == len(prompt) + 1
        np.testing.assert_allclose(out.logits.values[0], ref, atol=ATOL, rtol=0)
    for out in outs:
        client.release_cache(out.kv_cache)


def _same_rows(a, b) -> None:
    """Two replies' logits: same kind, ids and shape; values equal to float32 rounding (the
    twin sequences were prefilled apart, the second one from the prefix cache)."""
    from ferrum_rpc import tensor_codec

    assert a.kind == b.kind and list(a.token_ids) == list(b.token_ids) and a.positions == b.positions
    if a.HasField("values"):  # FULL
        np.testing.assert_allclose(tensor_codec.to_numpy(a.values), tensor_codec.to_numpy(b.values), atol=1e-5,
                                   rtol=0)
    np.testing.assert_allclose(list(a.scores), list(b.scores), atol=1e-5, rtol=0)  # TOP_K / ARGMAX


def _single_vs_per_item(server, client, prompts, call):
    """Decodes twin sequences of ``prompts`` once with one reply per item and once
    with ``single_reply``; ``call(stub, handles, single)`` sends the request and
    returns the replies.  Checks the single reply holds the same rows, in order;
    returns it."""
    import grpc

    from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

    twins = [[client.prefill(p).kv_cache for p in prompts] for _ in range(2)]
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        per_item, (one,) = (call(stub, handles, single) for single, handles in zip((False, True), twins))
    assert len(per_item) == len(prompts) and [r.index for r in one.results] == list(range(len(prompts)))
    for a, b in zip(sorted(per_item, key=lambda r: r.index), one.results):
        _same_rows(a.logits, b.logits)
        assert a.kv_cache.sequence_length == b.kv_cache.sequence_length
    for handles in twins:
        for h in handles:
            client.release_cache(h.cache_id)
    return one


def test_batch_decode_single_reply_carries_what_the_stream_carries(tiny_server, client):
    """BatchDecodeRequest.single_reply: one message with every result in order,
    the same rows as one stream message per sequence (the size rule is in test_failures)."""
    from ferrum_rpc import convert
    from ferrum_rpc.v1 import executor_pb2 as pb

    def call(stub, handles, single):
        req = pb.BatchDecodeRequest(logits=convert.policy_to_proto(LogitsPolicy.topk(5)), single_reply=single)
        for i, h in enumerate(handles):
            req.items.add(token_id=40 + i, kv_cache=convert.handle_to_proto(h))
        return list(stub.BatchDecode(req, timeout=30))

    _single_vs_per_item(tiny_server, client, [[1, 2, 3], list(range(10, 21)), [7]], call)


def test_session_single_reply_carries_what_per_item_replies_carry(tiny_server, client):
    from ferrum_rpc import convert
    from ferrum_rpc.v1 import executor_pb2 as pb

    def call(stub, handles, single):
        req = pb.DecodeSessionRequest(step_id=9, logits=convert.policy_to_proto(LogitsPolicy.topk(3)),
                                      single_reply=single)
        for h in handles:
            req.items.add(token_id=11, kv_cache=convert.handle_to_proto(h))
        return list(stub.DecodeSession(iter([req]), timeout=30))

    one = _single_vs_per_item(tiny_server, client, [[4, 5, 6], [7] * 9], call)
    assert [r.step_id for r in one.results] == [9, 9]


def test_chunked_prefill_equals_one_shot(client):
    prompt = list(range(3, 40))
    one_shot = client.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
    first = client.prefill(prompt[:10])
    second = client.prefill(prompt[10:25], kv_cache=first.kv_cache)
    third = client.prefill(prompt[25:], kv_cache=second.kv_cache, logits=LogitsPolicy.full(all_positions=True))
    assert third.kv_cache.cache_id == first.kv_cache.cache_id
    assert third.kv_cache.sequence_length == len(prompt)
    np.testing.assert_allclose(third.logits.values, one_shot.logits.values[25:], atol=ATOL, rtol=0)
    a = client.decode(9, one_shot.kv_cache).logits.values
    b = client.decode(9, third.kv_cache).logits.values
    np.testing.assert_allclose(a, b, atol=ATOL, rtol=0)


def test_truncate_then_redecode_equals_original_path(client):
    prompt = [4, 8, 15, 16, 23, 42]
    handle = client.prefill(prompt).kv_cache
    original = []
    for token in (100, 101, 102):
        step = client.decode(token, handle)
        original.append(step.logits.values[0])
        handle = step.kv_cache
    # Roll back the last two tokens (as after a rejected draft) and take the other path again.
    handle = client.truncate_kv(handle, len(prompt) + 1)
    assert handle.sequence_length == len(prompt) + 1
    for token, ref in zip((101, 102), original[1:]):
        step = client.decode(token, handle)
        np.testing.assert_allclose(step.logits.values[0], ref, atol=ATOL, rtol=0)
        handle = step.kv_cache
    # Truncating across a block boundary frees blocks and still decodes correctly.
    before = client.status().kv_blocks_used
    short = client.truncate_kv(handle, 2)
    assert client.status().kv_blocks_used < before
    assert len(short.block_table.block_ids) == 1
    fresh = client.prefill(prompt[:2]).kv_cache
    np.testing.assert_allclose(client.decode(5, short).logits.values, client.decode(5, fresh).logits.values,
                               atol=ATOL, rtol=0)


def test_forward_verify_rows_equal_sequential_decodes(client):
    prompt = [9, 8, 7, 6, 5]
    draft = [31, 32, 33, 34]
    base = client.prefill(prompt).kv_cache
    verify = client.forward_verify(draft, base)
    assert verify.logits.values.shape == (len(draft), 320)
    assert verify.kv_cache.sequence_length == len(prompt) + len(draft)

    handle = client.prefill(prompt).kv_cache
    for row, token in zip(verify.logits.values, draft):
        step = client.decode(token, handle)
        np.testing.assert_allclose(row, step.logits.values[0], atol=ATOL, rtol=0)
        handle = step.kv_cache


def test_logits_policies_agree_with_full_logits(client):
    handle = client.prefill([1, 2, 3, 4]).kv_cache
    full = client.decode(10, handle).logits.values[0]
    handle2 = client.prefill([1, 2, 3, 4]).kv_cache
    top = client.decode(10, handle2, logits=LogitsPolicy.topk(5)).logits
    assert list(top.token_ids[0]) == list(np.argsort(-full)[:5])
    np.testing.assert_allclose(top.values[0], np.sort(full)[::-1][:5], atol=ATOL, rtol=0)
    handle3 = client.prefill([1, 2, 3, 4]).kv_cache
    arg = client.decode(10, handle3, logits=LogitsPolicy.argmax()).logits
    assert arg.argmax() == [int(full.argmax())]
    for dtype, tol in (("float16", 1e-2), ("bfloat16", 5e-2)):
        h = client.prefill([1, 2, 3, 4]).kv_cache
        low = client.decode(10, h, logits=LogitsPolicy.full(dtype=dtype)).logits.values[0]
        assert low.dtype == np.float32 if dtype == "bfloat16" else low.dtype == np.float16
        np.testing.assert_allclose(low.astype(np.float32), full, atol=tol * max(1.0, np.abs(full).max()))


@pytest.mark.parametrize("step", [FUSED, "eager"])
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bfloat16_serving_stays_close_to_float32_transformers(arch, kernel, step, tiny_llama_dir, tiny_qwen3_dir):
    """bfloat16 runs through other kernels (the panel GEMM's bfloat16 chain, oneDNN packed
    weights where the CPU has them); each path must still compute the same model."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    oracle = hf_oracle(model_dir, arch)
    prompt = [5, 17, 101, 3, 250, 42, 7, 9]
    ref = oracle_rows(oracle, prompt + [11])
    with running_server(model_dir, dtype="bfloat16", **_kernels(kernel, step)) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        assert ex.info().dtype == "bfloat16"
        out = ex.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
        step = ex.batch_decode([(11, out.kv_cache), (11, ex.prefill(prompt).kv_cache)])
    scale = np.abs(ref).max()
    np.testing.assert_allclose(out.logits.values, ref[:-1], atol=0.03 * scale, rtol=0)
    for s in step:
        np.testing.assert_allclose(s.logits.values[0], ref[-1], atol=0.03 * scale, rtol=0)


@pytest.mark.parametrize("arch,step", [pytest.param("llama", "fused", marks=pytest.mark.cpu_only), ("llama", "eager"),
                                       pytest.param("qwen3", "fused", marks=pytest.mark.cpu_only)])
def test_a_bfloat16_kv_pool_matches_transformers_with_its_cache_rounded(arch, step, tiny_llama_dir, tiny_qwen3_dir):
    """--kv-dtype bfloat16 under float32 activations: each key (after RoPE) and value
    rounded to bfloat16 once, as written; every other step in float32.  transformers
    with a cache that rounds the same way must give the same logits to float32's
    tolerance, prompt and greedy steps, on the fused ops (the panel GEMM's one-region
    step) and the eager ones."""
    model_dir = tiny_llama_dir if arch == "llama" else tiny_qwen3_dir
    oracle = hf_oracle(model_dir, arch)
    prompt = [5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 64, 2, 77]

    with running_server(model_dir, kv_dtype="bfloat16", step_ops=step) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        info, caps = ex.info(), ex.capabilities()
        assert (info.dtype, info.kv_dtype) == ("float32", "bfloat16")
        assert caps.memory.kv_bytes_per_token_per_layer == 2 * info.num_kv_heads * info.head_dim * 2
        out = ex.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
        ref = oracle_rows(oracle, prompt, torch.bfloat16)
        np.testing.assert_allclose(out.logits.values, ref, atol=ATOL, rtol=0)
        off = lambda want: np.abs(out.logits.values - want).max()  # noqa: E731
        assert 10 * off(ref) < off(oracle_rows(oracle, prompt))  # the rounding is seen: far nearer its oracle
        ids, handle, token = list(prompt), out.kv_cache, int(ref[-1].argmax())
        for _ in range(16):
            ids.append(token)
            out = ex.decode(token, handle)
            handle, ref_row = out.kv_cache, oracle_rows(oracle, ids, torch.bfloat16)[-1]
            np.testing.assert_allclose(out.logits.values[0], ref_row, atol=ATOL, rtol=0)
            token = int(ref_row.argmax())
        ex.release_cache(handle)


def test_a_kv_dtype_the_model_cannot_hold_is_a_startup_error():
    from ferrum_rpc.errors import StartupError
    from ferrum_rpc.server.config import ExecutorConfig

    with pytest.raises(StartupError, match="--kv-dtype float32 needs --dtype float32"):
        ExecutorConfig(dtype="bfloat16", kv_dtype="float32")
    with pytest.raises(StartupError, match="kv_dtype must be one of"):
        ExecutorConfig(kv_dtype="float16")
    assert ExecutorConfig(dtype="bfloat16", kv_dtype="bfloat16").kv_dtype_name == "bfloat16"
    assert ExecutorConfig(quantize="int8", kv_dtype="bfloat16").kv_dtype_name == "bfloat16"
    assert ExecutorConfig(dtype="bfloat16").kv_dtype_name == "bfloat16"
    # auto: bfloat16 where activations are rounded to 8 bits a block anyway, else the model's dtype
    assert [ExecutorConfig(quantize=q).kv_dtype_name for q in ("none", "int8", "int4", "w8a8", "w4a8")] == \
        ["float32"] * 3 + ["bfloat16"] * 2
    assert ExecutorConfig(quantize="w4a8", kv_dtype="float32").kv_dtype_name == "float32"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_executor_matches_transformers(tiny_llama_dir, hf_tiny_llama):
    prompt = [5, 17, 101, 3, 250, 42, 7]
    ref = oracle_rows(hf_tiny_llama, prompt + [9])
    with running_server(tiny_llama_dir, device="cuda") as server, ExecutorClient(server.target, timeout=30) as ex:
        out = ex.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
        assert out.kv_cache.device.startswith("cuda")
        np.testing.assert_allclose(out.logits.values, ref[:-1], atol=ATOL, rtol=0)
        step = ex.decode(9, out.kv_cache)
        np.testing.assert_allclose(step.logits.values[0], ref[-1], atol=ATOL, rtol=0)
