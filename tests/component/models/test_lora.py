"""LoRA adapters on our model against transformers + peft on the same weights: prefill
and decode steps with the KV pool, every target module, ranks 8 and 64, rsLoRA,
per-module ranks and alphas, a subset of layers, Qwen3, a quantized base; batches
mixing adapters and the base give each sequence what it gets alone (bit for bit on
a batch-invariant model)."""

from __future__ import annotations

import pytest
import torch

from ferrum_rpc.server.kv.pool import RaggedBatch
from ferrum_rpc.server.models import load_model
from ferrum_rpc.server.models.lora import AdapterSet
from tests.component.models.lora_helpers import make_adapter, oracle, run

ATOL = 1e-4
CPU = torch.device("cpu")
PROMPTS = [[5, 17, 101, 3, 250, 42, 7], [8, 1, 99], list(range(20, 41)), [300, 2, 64, 11], [9, 9, 9, 9, 9, 1]]
FEEDS = [[7, 3, 12, 200, 5, 88, 1, 42], [2, 4, 6, 8, 10, 12, 14, 16], [310, 0, 31, 100, 101, 102, 5, 6],
         [1, 1, 2, 3, 5, 8, 13, 21], [40, 30, 20, 10, 0, 9, 19, 29]]


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """Four adapters on the tiny Llama: ranks 8 and 64, rsLoRA, and one on q/v only."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_adapter(tiny_llama_dir, root / "r8", seed=1, r=8, alpha=16),
            make_adapter(tiny_llama_dir, root / "r64", seed=2, r=64, alpha=32),
            make_adapter(tiny_llama_dir, root / "rs16", seed=3, r=16, alpha=8, use_rslora=True),
            make_adapter(tiny_llama_dir, root / "qv", seed=4, r=4, alpha=4, targets=["q_proj", "v_proj"])]


def _check(got: torch.Tensor, logits, prompt: list[int], feed: list[int]) -> None:
    want = logits(prompt + feed)[len(prompt) - 1:]
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("which,per_token,step_ops", [(0, False, "auto"), (1, False, "auto"), (2, True, "auto"),
                                                     (3, True, "auto"), (0, False, "eager"), (3, True, "eager")])
def test_adapter_logits_equal_transformers_with_peft(tiny_llama_dir, adapters, which, per_token, step_ops):
    """auto: the fused step ops, the deltas in lora.cpp (decode steps inside the decode
    stack); eager: torch GEMMs."""
    model = load_model(tiny_llama_dir, torch.float32, CPU, step_ops=step_ops)
    registry = AdapterSet(model, max_adapters=4, max_rank=64)
    slot = registry.add("a", adapters[which])
    fast = step_ops == "auto"
    assert (registry.get("a").kernel is not None) == fast and (model.layer_ops is not None) == fast
    logits, base = oracle(tiny_llama_dir, adapters[which]), oracle(tiny_llama_dir, None)
    got = run(model, PROMPTS[:2], [slot, slot], FEEDS[:2], per_token=per_token)
    for rows, prompt, feed in zip(got, PROMPTS, FEEDS):
        _check(rows, logits, prompt, feed)
        assert (rows - base(prompt + feed)[len(prompt) - 1:]).abs().max() > 100 * ATOL  # the adapter moved them


def test_rank_and_alpha_patterns_and_a_subset_of_layers(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    """PEFT's per-module ranks and alphas, layers_to_transform, and a Qwen3 base (its q/k norms)."""
    pattern = make_adapter(tiny_llama_dir, tmp_path / "p", seed=5, r=8, alpha=16,
                           rank_pattern={"q_proj": 16, "down_proj": 2}, alpha_pattern={"v_proj": 3, "o_proj": 40})
    layer1 = make_adapter(tiny_llama_dir, tmp_path / "l1", seed=6, r=8, alpha=8, layers_to_transform=[1],
                          targets=["k_proj", "up_proj", "down_proj"])
    qwen = make_adapter(tiny_qwen3_dir, tmp_path / "qw", seed=7, r=8, alpha=16, use_rslora=True)
    for model_dir, folder in ((tiny_llama_dir, pattern), (tiny_llama_dir, layer1), (tiny_qwen3_dir, qwen)):
        model = load_model(model_dir, torch.float32, CPU)
        slot = AdapterSet(model).add("a", folder)
        got = run(model, PROMPTS[:1], [slot], FEEDS[:1])
        _check(got[0], oracle(model_dir, folder), PROMPTS[0], FEEDS[0])


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize("order", ["scattered", "sorted"])
def test_a_batch_mixing_adapters_and_the_base_gives_each_row_what_it_gets_alone(tiny_llama_dir, adapters,
                                                                                invariant, order):
    """Five sequences of different lengths, four adapters and the base, prefill then 5
    decode steps in one batch: each sequence's logits are what it gets alone (the same
    bits on a batch-invariant model), and what transformers + peft give."""
    model = load_model(tiny_llama_dir, torch.float32, CPU, batch_invariant=invariant)
    registry = AdapterSet(model, max_adapters=4, max_rank=64)
    slots = [registry.add(f"a{i}", folder) for i, folder in enumerate(adapters)]
    # scattered: the groups' rows interleave (gathered); sorted: each group's rows are contiguous
    picks = [slots[2], -1, slots[0], slots[3], slots[1]] if order == "scattered" else [-1] + slots
    prompts, feeds = PROMPTS, [f[:5] for f in FEEDS]
    if order == "scattered":  # two rows of one adapter apart from each other
        picks, prompts, feeds = picks + [slots[2]], prompts + [PROMPTS[1]], feeds + [FEEDS[3][:5]]
    together = run(model, prompts, picks, feeds)
    oracles = {s: oracle(tiny_llama_dir, adapters[slots.index(s)] if s >= 0 else None) for s in set(picks)}
    for rows, prompt, feed, slot in zip(together, prompts, feeds, picks):
        alone = run(model, [prompt], [slot], [feed])[0]
        if invariant:
            assert torch.equal(rows, alone)
        else:
            torch.testing.assert_close(rows, alone, atol=1e-5, rtol=0)
        _check(rows, oracles[slot], prompt, feed)


def test_a_ragged_batch_takes_its_slots_per_token(tiny_llama_dir, adapters):
    """The engine's unified forward (a RaggedBatch: a decode group and a prompt group in
    one (1, N) row of tokens) with slots per token."""
    from ferrum_rpc.server.kv.pool import KvPool

    model = load_model(tiny_llama_dir, torch.float32, CPU)
    registry = AdapterSet(model, max_adapters=4, max_rank=64)
    a, b = registry.add("a", adapters[0]), registry.add("b", adapters[2])
    cfg = model.config
    pool = KvPool(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    first, second = PROMPTS[1], PROMPTS[0]  # first runs its prompt before, then decodes a token
    kv = pool.batch([[0, 1, 2]], [0], [len(first)])
    model(torch.tensor([first]), kv.positions, kv, adapter_slots=torch.tensor([a]))
    ragged = RaggedBatch(pool, [([[0, 1, 2]], [len(first)], 1), ([[3, 4, 5], [6, 7, 8]], [0, 0], len(second))])
    ids = [5] + second + second  # the decode token, then one prompt twice (a group has one width)
    slots = [a] + [b] * len(second) + [-1] * len(second)
    hidden = model(torch.tensor([ids]), None, ragged, adapter_slots=torch.tensor([slots]))
    logits = model.logits(hidden[0])
    torch.testing.assert_close(logits[0], oracle(tiny_llama_dir, adapters[0])(first + [5])[-1], atol=ATOL, rtol=0)
    n = len(second)
    torch.testing.assert_close(logits[1:1 + n], oracle(tiny_llama_dir, adapters[2])(second), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1 + n:], oracle(tiny_llama_dir, None)(second), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernel", ["auto", "woq"])
def test_a_quantized_base_keeps_its_kernels_and_adds_the_delta_in_float(tiny_llama_dir, adapters, kernel,
                                                                        monkeypatch):
    """int8: the base projections run quantized (the whole-layer op for base-only steps),
    the adapter's delta is added in float: transformers with our dequantized weights
    plus peft's adapter gives the same logits, within the quantized tests' tolerance."""
    from ferrum_rpc.server.kernels import qact
    from tests.component.kernels.test_woq import _oracle_with_our_weights

    if kernel == "woq":  # the weight-only kernels on float activations (woq.cpp)
        monkeypatch.setattr(qact, "choose_kernel", lambda requested: (qact.TORCH_Q8, "fallback: not in this test"))
    model = load_model(tiny_llama_dir, torch.float32, CPU, quantize="int8")
    assert model.kernels.linear.startswith("int8 " + ("ferrum-woq" if kernel == "woq" else qact.QACT))
    slot = AdapterSet(model, max_rank=64).add("a", adapters[1])
    logits = oracle(tiny_llama_dir, adapters[1], model=_oracle_with_our_weights(tiny_llama_dir, "llama", "int8"))
    base = run(model, PROMPTS[:2], [-1, -1], FEEDS[:2])
    with_adapter = run(model, PROMPTS[:2], [slot, slot], FEEDS[:2])
    for rows, prompt, feed in zip(with_adapter, PROMPTS, FEEDS):
        _check(rows, logits, prompt, feed)
    assert (base[0] - with_adapter[0]).abs().max() > 100 * ATOL
    mixed = run(model, PROMPTS[:2], [slot, -1], FEEDS[:2])  # the adapter's row and a base row
    torch.testing.assert_close(mixed[0], with_adapter[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1], base[1], atol=1e-5, rtol=0)
