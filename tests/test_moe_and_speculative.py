"""Qwen3-MoE parity with transformers, and greedy speculative decoding == greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.client.speculative import ModelDrafter, NgramDrafter, speculative_generate
from tests.conftest import TINY, running_server

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(**TINY, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    model = Qwen3MoeForCausalLM(cfg).eval()
    # random init leaves experts nearly identical; spread them so routing matters
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(path)
    return path


def test_moe_prefill_and_16_greedy_steps_match_transformers(tiny_moe_dir):
    from transformers import Qwen3MoeForCausalLM

    oracle = Qwen3MoeForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32).eval()
    prompt = [5, 17, 101, 3, 250, 42, 7, 9, 300, 11]
    with running_server(tiny_moe_dir) as server, ExecutorClient(server.target) as ex:
        caps = ex.capabilities()
        assert caps.mixture_of_experts and caps.architecture == "qwen3_moe"
        out = ex.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
        with torch.no_grad():
            ref = oracle(torch.tensor([prompt])).logits[0].numpy()
        np.testing.assert_allclose(out.logits.values, ref, atol=ATOL, rtol=0)
        ids, handle, token = list(prompt), out.kv_cache, int(ref[-1].argmax())
        for _ in range(16):
            ids.append(token)
            step = ex.decode(token, handle)
            handle = step.kv_cache
            with torch.no_grad():
                ref_row = oracle(torch.tensor([ids])).logits[0, -1].numpy()
            np.testing.assert_allclose(step.logits.values[0], ref_row, atol=ATOL, rtol=0)
            token = int(ref_row.argmax())
        # batched decode routes every sequence's tokens correctly
        a, b = ex.prefill(prompt[:4]).kv_cache, ex.prefill(prompt[:7]).kv_cache
        outs = ex.batch_decode([(1, a), (2, b)])
        with torch.no_grad():
            ra = oracle(torch.tensor([prompt[:4] + [1]])).logits[0, -1].numpy()
            rb = oracle(torch.tensor([prompt[:7] + [2]])).logits[0, -1].numpy()
        np.testing.assert_allclose(outs[0].logits.values[0], ra, atol=ATOL, rtol=0)
        np.testing.assert_allclose(outs[1].logits.values[0], rb, atol=ATOL, rtol=0)


def test_ngram_drafter_proposes_what_followed_the_last_match():
    drafter = NgramDrafter(max_ngram=2)
    assert drafter.draft([1, 2, 3, 4, 1, 2], 2) == [3, 4]
    assert drafter.draft([5, 6, 7], 3) == []


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_greedy_on_a_tiny_model(client, k):
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11, 7, 8]
    expected = list(generate_ids(client, prompt, 24, SamplingParams(greedy=True)))
    before = client.status().kv_blocks_used
    result = speculative_generate(client, prompt, 24, k=k)
    assert result.tokens == expected
    assert result.target_forwards <= len(expected)
    assert client.status().kv_blocks_used == before  # everything released


def test_speculative_with_a_draft_model_on_the_same_server(tiny_llama_dir, tiny_qwen3_dir):
    from ferrum_rpc.server.app import BackgroundServer
    from ferrum_rpc.server.config import ExecutorConfig, ModelSpec, ServerConfig

    config = ServerConfig(models=(ModelSpec("target", str(tiny_llama_dir)), ModelSpec("draft", str(tiny_llama_dir))),
                          port=0, executor=ExecutorConfig(kv_tokens=1024, block_size=4))
    with BackgroundServer(config) as server:
        with ExecutorClient(server.target, model="target") as target, \
                ExecutorClient(server.target, model="draft") as draft:
            prompt = [3, 14, 15, 92, 65]
            expected = list(generate_ids(target, prompt, 20, SamplingParams(greedy=True)))
            result = speculative_generate(target, prompt, 20, k=4, drafter=ModelDrafter(draft))
            assert result.tokens == expected
            # the draft is the same weights, so every draft is accepted
            assert result.acceptance_rate == 1.0
            assert result.target_forwards < len(expected)
            assert draft.status().active_sequences == 0 and target.status().active_sequences == 0
