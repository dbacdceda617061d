"""Batch invariance (--batch-invariant), through real gRPC: a sequence's float32 logits
at a position are bit-identical alone and inside batches of other sequences of other
lengths in any order, with its prompt cold, from the prefix cache, or in any chunking,
and a prompt token's logits equal the same token's decode logits; a seeded generation
gives the same tokens alone and while other callers share its forwards.  float32 and
bfloat16 on the tiny Llama and Qwen3 checkpoints, and the quantized modes (int8, int4,
w8a8 rotated on Q4_1-grid weights, w4a8 in float32 and bfloat16) on csrc/qact.cpp's
inner loops: AVX-512 VNNI, AVX-VNNI, AVX2 and portable, each where this CPU has it;
float32 split over two tensor-parallel ranks (real rank processes); and float32 over a
bfloat16 KV pool (--kv-dtype bfloat16; w8a8 and w4a8 hold one by default, int8 and int4
a float32 one), and an int8 pool (--kv-dtype int8) under float32 and bfloat16 w4a8."""

from __future__ import annotations

import contextlib
import random
import threading

import numpy as np
import pytest
import torch

from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy, TokenChoice
from ferrum_rpc.errors import StartupError
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.kernels.build import load_library
from ferrum_rpc.harness import ServerProcess, all_serving
from tests.conftest import running_server

pytestmark = pytest.mark.cpu_only  # the CPU kernels' paths and guarantees

FULL = LogitsPolicy.full()
ALL = LogitsPolicy(all_positions=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 300) for _ in range(n)]


def _bits(out) -> np.ndarray:
    values = np.asarray(out.logits.values, dtype=np.float32)
    return values.view(np.uint32)


# (model, dtype, --quantize, inner loops: the cap set on csrc's kernels, "" for the best here,
# and optionally "tp2" (split over 2 tensor-parallel ranks) or "kv-bf16" / "kv-f32" / "kv-int8" (--kv-dtype
# bfloat16, float32 or int8; by default w8a8 and w4a8 keep a bfloat16 pool, the rest their dtype's))
CASES = [("llama", "float32", "none", ""), ("llama", "bfloat16", "none", ""), ("qwen3", "float32", "none", ""),
         ("llama", "float32", "int8", ""), ("q4llama", "float32", "int4", ""), ("q4llama", "float32", "w8a8", ""),
         ("qwen3", "float32", "w4a8", ""), ("llama", "bfloat16", "w4a8", ""),
         ("q4llama", "float32", "w8a8", "avx-vnni"), ("q4llama", "float32", "w8a8", "avx2"),
         ("llama", "float32", "int4", "avx2"), ("llama", "float32", "int8", "avx2"), ("llama", "float32", "w4a8", "avx2"),
         ("llama", "float32", "int8", "portable"),
         ("llama", "float32", "none", "", "tp2"), ("llama", "float32", "none", "", "kv-bf16"),
         ("llama", "float32", "none", "", "kv-int8"), ("llama", "bfloat16", "w4a8", "", "kv-int8")]


@contextlib.contextmanager
def _inner_loops(name: str):
    """csrc's kernels capped at ``name``'s inner loops (woq.cpp's cap binds every file,
    qact.cpp's picks among its VNNI loops), skipping where this CPU lacks them."""
    if not name:
        yield
        return
    load_library()
    woq_cap, qact_cap = {"avx-vnni": ("avx2", "avx-vnni"), "avx2": ("avx2", "avx2"),
                         "portable": ("portable", "portable")}[name]
    try:
        torch.ops.ferrum_woq.set_max_isa(woq_cap)
        if torch.ops.ferrum_qact.set_max_isa(qact_cap) != name:
            pytest.skip(f"this CPU has no {name} inner loops (runs {torch.ops.ferrum_qact.isa()})")
        yield
    finally:
        torch.ops.ferrum_woq.set_max_isa("avx512")
        torch.ops.ferrum_qact.set_max_isa("avx512-vnni")


@pytest.fixture(scope="module", params=CASES, ids=lambda p: "-".join(f for f in p if f))
def server(request, tiny_llama_dir, tiny_qwen3_dir, tiny_q4_llama_dir):
    name, dtype, quantize, loops, *more = request.param
    model = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "q4llama": tiny_q4_llama_dir}[name]
    kv_dtype = {"kv-bf16": "bfloat16", "kv-f32": "float32", "kv-int8": "int8"}.get(more[0] if more else "", "auto")
    if more == ["tp2"]:  # ranks are processes of a `ferrum-rpc serve`
        serving = all_serving(ServerProcess(f"tiny={model}", "--dtype", dtype, "--batch-invariant",
                                            "--tensor-parallel", "2", "--prefill-chunk", "16",
                                            "--step-token-budget", "24", "--kv-tokens", "2048", "--block-size",
                                            "4", "--no-warmup"), timeout=180)
    else:
        # the default configuration: batch-invariant wherever it can be
        serving = running_server(model, dtype=dtype, kv_dtype=kv_dtype, quantize=quantize, prefill_chunk=16,
                                 step_token_budget=24)
    with _inner_loops(loops), serving as srv:
        if more == ["tp2"]:
            (srv,) = srv
        srv.case = request.param
        yield srv


@pytest.fixture
def client(server):
    with ExecutorClient(server.target, timeout=60) as c:
        yield c


def test_capabilities_say_so(server, client):
    caps = client.capabilities()
    assert caps.batch_invariant
    name, dtype, quantize, _, *more = server.case
    kv_dtype = {"kv-bf16": "bfloat16", "kv-f32": "float32", "kv-int8": "int8"}.get(more[0] if more else "", "auto")
    assert client.info().kv_dtype == ExecutorConfig(dtype=dtype, quantize=quantize, kv_dtype=kv_dtype).kv_dtype_name
    quantize, loops = server.case[2:4]
    if quantize != "none":  # every linear on qact.cpp's kernels, on the inner loops asked for
        assert caps.quantization == quantize and f"linear={quantize} ferrum-qact" in caps.kernel_path
        assert torch.ops.ferrum_qact.isa() == (loops or torch.ops.ferrum_qact.isa())


def _decode_row(client, prompt, token, others=(), seed=0):
    """The target's FULL decode logits of ``token`` after ``prompt``, decoded inside a
    BatchDecode with ``others`` (each (prompt, token)), in a shuffled order."""
    target = client.prefill(prompt, logits=LogitsPolicy.argmax()).kv_cache
    handles = [(client.prefill(p, logits=LogitsPolicy.argmax()).kv_cache, t) for p, t in others]
    items = [DecodeInput(token, target)] + [DecodeInput(t, h) for h, t in handles]
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    outs = client.batch_decode([items[i] for i in order], logits=FULL)
    row = _bits(outs[order.index(0)])
    for out in outs:
        client.release_cache(out.kv_cache)
    return row


@pytest.mark.parametrize("others", [1, 15, 40])
def test_decode_logits_do_not_depend_on_the_batch(client, others):
    prompt, token = _prompt(23, seed=1), 77
    alone = _decode_row(client, prompt, token)
    company = [(_prompt(3 + 7 * i % 50, seed=100 + i), 5 + i) for i in range(others)]
    assert np.array_equal(_decode_row(client, prompt, token, company, seed=others), alone)


def test_chunking_and_the_prefix_cache_change_no_bit(client):
    prompt = _prompt(45, seed=2)
    cold = client.prefill(prompt, logits=FULL)  # the server runs it in parts of 16
    hit = client.prefill(prompt, logits=FULL)  # full blocks from the prefix cache
    assert hit.cached_tokens > 0
    parts = client.prefill(prompt[:7], logits=FULL).kv_cache  # the caller's own parts: 7, 20, 18
    parts = client.prefill(prompt[7:27], parts, logits=FULL).kv_cache
    last = client.prefill(prompt[27:], parts, logits=FULL)
    assert np.array_equal(_bits(hit), _bits(cold)) and np.array_equal(_bits(last), _bits(cold))
    steps = [client.decode(9, h.kv_cache if hasattr(h, "kv_cache") else h, logits=FULL)
             for h in (cold, hit, last)]
    assert all(np.array_equal(_bits(s), _bits(steps[0])) for s in steps)
    for s in steps:
        client.release_cache(s.kv_cache)


def test_a_prompt_tokens_logits_equal_its_decode_logits(client):
    prompt = _prompt(30, seed=3)
    rows = client.prefill(prompt, logits=ALL)  # every position's logits, one forward per part
    every = np.asarray(rows.logits.values, dtype=np.float32).view(np.uint32)
    handle = client.prefill(prompt[:10], logits=LogitsPolicy.argmax()).kv_cache
    for i in range(10, 30):  # the same tokens one decode at a time
        out = client.decode(prompt[i], handle, logits=FULL)
        assert np.array_equal(_bits(out)[0], every[i]), i
        handle = out.kv_cache
    client.release_cache(handle)
    client.release_cache(rows.kv_cache)


def _generate(client, prompt, seed, steps=24):
    out = client.prefill(prompt, token_choice=TokenChoice(temperature=1.0, seed=seed))
    run = client.decode_ahead(out.chosen.token_id, out.kv_cache, TokenChoice(temperature=1.0, seed=seed), steps)
    client.release_cache(run.kv_cache)
    return [out.chosen.token_id] + [c.token_id for c in run.chosen]


def test_seeded_generation_is_the_same_alone_and_under_load(server, client):
    if server.case[3]:  # a capped inner loop: its rows' arithmetic is what the tests above check
        pytest.skip("the generation under load runs on each model's best inner loops")
    prompts = [_prompt(5 + 9 * i, seed=20 + i) for i in range(6)]
    alone = [_generate(client, p, seed=i) for i, p in enumerate(prompts)]
    stop = threading.Event()

    def load(n):
        with ExecutorClient(server.target, timeout=60) as other:
            while not stop.is_set():
                _generate(other, _prompt(3 + 11 * n, seed=500 + n), seed=n, steps=8)

    threads = [threading.Thread(target=load, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    try:
        loaded = [_generate(client, p, seed=i) for i, p in enumerate(prompts)]
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert loaded == alone


def test_options_it_cannot_serve_are_refused_at_start():
    for bad in (dict(step_ops="eager"), dict(device="cuda")):
        with pytest.raises(StartupError, match="--batch-invariant"):
            ExecutorConfig(batch_invariant=True, **bad)


def test_the_default_is_invariant_where_it_can_be_and_says_why_not(tiny_llama_dir, tiny_moe_dir, caplog):
    """--batch-invariant auto (the default) turns it on where the model, dtype and kernels allow
    and logs why not elsewhere; on (the bare flag) refuses to start there instead; off is off."""
    from ferrum_rpc.cli import build_parser
    from ferrum_rpc.server.models.loader import load_model

    parse = lambda *a: build_parser().parse_args(["serve", *a]).batch_invariant  # noqa: E731
    assert (parse(), parse("--batch-invariant"), parse("--batch-invariant", "off")) == ("auto", "on", "off")
    assert ExecutorConfig().batch_invariant == "auto" and ExecutorConfig(batch_invariant=True).batch_invariant == "on"
    cpu = torch.device("cpu")
    assert load_model(tiny_llama_dir, torch.float32, cpu).batch_invariant
    assert load_model(tiny_llama_dir, torch.bfloat16, cpu).batch_invariant
    assert not load_model(tiny_llama_dir, torch.float32, cpu, batch_invariant="off").batch_invariant
    for model_dir, options, why in ((tiny_moe_dir, {}, "mixture-of-experts"),
                                    (tiny_llama_dir, dict(linear_kernel="aten"), "--linear-kernel auto, not aten"),
                                    (tiny_llama_dir, dict(step_ops="eager"), "fused CPU ops")):
        caplog.clear()
        with caplog.at_level("INFO", logger="ferrum_rpc.server.models.loader"):
            assert not load_model(model_dir, torch.float32, cpu, **options).batch_invariant
        assert any("not batch-invariant: --batch-invariant" in r.message and why in r.message
                   for r in caplog.records), why
        if "linear_kernel" not in options:  # on: the linear kernel asked for is overridden, not refused
            with pytest.raises(StartupError, match=f"--batch-invariant .*{why}"):
                load_model(model_dir, torch.float32, cpu, batch_invariant="on", **options)
