"""Qwen3-MoE parity with transformers, and greedy speculative decoding == greedy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.client.speculative import ModelDrafter, NgramDrafter, speculative_generate
from tests.conftest import running_server

ATOL = 1e-4


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


@pytest.mark.parametrize("server_side", [True, False], ids=["SpeculativeDecode", "verify+truncate"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_speculative_equals_greedy_on_a_tiny_model(client, k, server_side):
    prompt = [7, 8, 9, 7, 8, 9, 7, 8, 9, 10, 11, 7, 8]
    expected = list(generate_ids(client, prompt, 24, SamplingParams(greedy=True)))
    before = client.status().kv_blocks_used
    result = speculative_generate(client, prompt, 24, k=k, server_side=server_side)
    assert result.tokens == expected
    assert result.target_forwards <= len(expected)
    assert client.status().kv_blocks_used == before  # everything released


@pytest.mark.parametrize("server_side", [True, False], ids=["SpeculativeDecode", "verify+truncate"])
def test_speculative_with_a_draft_model_on_the_same_server(tiny_llama_dir, tiny_qwen3_dir, server_side):
    from ferrum_rpc.server.app import BackgroundServer
    from ferrum_rpc.server.config import ExecutorConfig, ModelSpec, ServerConfig

    config = ServerConfig(models=(ModelSpec("target", str(tiny_llama_dir)), ModelSpec("draft", str(tiny_llama_dir))),
                          port=0, executor=ExecutorConfig(kv_tokens=1024, block_size=4))
    with BackgroundServer(config) as server:
        with ExecutorClient(server.target, model="target") as target, \
                ExecutorClient(server.target, model="draft") as draft:
            prompt = [3, 14, 15, 92, 65]
            expected = list(generate_ids(target, prompt, 20, SamplingParams(greedy=True)))
            result = speculative_generate(target, prompt, 20, k=4, drafter=ModelDrafter(draft),
                                          server_side=server_side)
            assert result.tokens == expected
            # the draft is the same weights, so every draft is accepted
            assert result.acceptance_rate == 1.0
            assert result.target_forwards < len(expected)
            assert draft.status().active_sequences == 0 and target.status().active_sequences == 0


def test_speculative_decode_rpc_equals_verify_then_truncate(tiny_llama_dir):
    """One SpeculativeDecode equals ForwardVerify + TruncateKv on a twin sequence: the
    same accepted drafts, next token, logits row and length; bad rounds change nothing."""
    from ferrum_rpc.errors import InvalidInput, LengthMismatch

    prompt = [3, 14, 15, 92, 65, 35]
    with running_server(tiny_llama_dir, prefix_caching=False) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        a = ex.prefill(prompt, logits=LogitsPolicy.argmax())
        b = ex.prefill(prompt, logits=LogitsPolicy.argmax())
        first = a.logits.argmax()[0]
        # drafts: greedy's own next two tokens, then a wrong one
        greedy = list(generate_ids(ex, prompt, 4, SamplingParams(greedy=True)))
        draft = greedy[1:3] + [(greedy[3] + 1) % 320, 5]
        spec = ex.speculative_decode(first, draft, a.kv_cache)
        verify = ex.forward_verify([first] + draft, b.kv_cache, logits=LogitsPolicy.full())
        predicted = verify.logits.argmax()
        assert spec.accepted_token_ids == tuple(draft[:2]) and spec.next_token_id == predicted[2] == greedy[3]
        np.testing.assert_array_equal(spec.logits.values[0], verify.logits.values[2])
        trimmed = ex.truncate_kv(verify.kv_cache, len(prompt) + 3)
        assert spec.kv_cache.sequence_length == trimmed.sequence_length == len(prompt) + 3
        # both continue identically from there
        x = ex.decode(spec.next_token_id, spec.kv_cache)
        y = ex.decode(spec.next_token_id, trimmed)
        np.testing.assert_array_equal(x.logits.values, y.logits.values)
        # no drafts: a plain decode step with greedy's token
        none = ex.speculative_decode(x.logits.argmax()[0], [], x.kv_cache, logits=LogitsPolicy.argmax())
        assert none.accepted_token_ids == () and none.kv_cache.sequence_length == x.kv_cache.sequence_length + 1
        # failures change nothing: a stale length, an id past the vocabulary, too many drafts
        state = (ex.status().kv_blocks_used, ex.status().active_sequences)
        with pytest.raises(LengthMismatch):
            ex.speculative_decode(1, [2], x.kv_cache)
        with pytest.raises(InvalidInput):
            ex.speculative_decode(1, [2, 10_000], none.kv_cache)
        with pytest.raises(InvalidInput, match="drafts exceed"):
            ex.speculative_decode(1, [2] * 300, none.kv_cache)
        assert (ex.status().kv_blocks_used, ex.status().active_sequences) == state
        assert ex.decode(1, none.kv_cache).kv_cache.sequence_length == none.kv_cache.sequence_length + 1


def test_batch_prefill_equals_single_prefills_and_is_all_or_nothing(tiny_llama_dir, hf_tiny_llama):
    from ferrum_rpc.errors import InvalidInput

    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11] * 12, [7]]
    with running_server(tiny_llama_dir) as server, ExecutorClient(server.target, timeout=30) as ex:
        outs = ex.batch_prefill(prompts, logits=LogitsPolicy.full(all_positions=True))
        assert [o.kv_cache.sequence_length for o in outs] == [len(p) for p in prompts]
        for prompt, out in zip(prompts, outs):
            with torch.no_grad():
                ref = hf_tiny_llama(torch.tensor([prompt])).logits[0].numpy()
            np.testing.assert_allclose(out.logits.values, ref, atol=ATOL, rtol=0)
        # continuations and new prompts together
        more = ex.batch_prefill([([21, 22], outs[0].kv_cache), [5, 5, 5], ([9], outs[3].kv_cache)])
        with torch.no_grad():
            ref = hf_tiny_llama(torch.tensor([prompts[0] + [21, 22]])).logits[0, -1].numpy()
        np.testing.assert_allclose(more[0].logits.values[0], ref, atol=ATOL, rtol=0)
        assert [m.kv_cache.sequence_length for m in more] == [5, 3, 2]
        # one bad prompt: nothing of the call is kept
        state = (ex.status().kv_blocks_used, ex.status().active_sequences)
        with pytest.raises(InvalidInput):
            ex.batch_prefill([[1, 2, 3, 4, 5, 6, 7, 8, 9], ([1], more[0].kv_cache), [10_000]])
        with pytest.raises(InvalidInput, match="at most once"):
            ex.batch_prefill([([1], more[0].kv_cache), ([2], more[0].kv_cache)])
        with pytest.raises(InvalidInput, match="at least one"):
            ex.batch_prefill([])
        assert (ex.status().kv_blocks_used, ex.status().active_sequences) == state
        assert ex.decode(1, more[0].kv_cache).kv_cache.sequence_length == 6  # untouched
        assert ex.capabilities().batch_prefill and ex.capabilities().speculative_decode


def test_probabilistic_acceptance_is_seeded_and_samples_the_target(tiny_llama_dir, hf_tiny_llama):
    """With `sampling`, the first token a round emits is distributed as the target's
    tempered distribution (checked against transformers' logits over 400 seeds), the
    same seed gives the same round, and top_k=1 is greedy acceptance."""
    import math
    from collections import Counter

    from ferrum_rpc.types import SpeculativeSampling

    prompt, temperature, n = [3, 14, 15, 92, 65, 35], 0.02, 400  # sharp enough that a few tokens matter
    with running_server(tiny_llama_dir, prefix_caching=False) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        head = ex.prefill(prompt, logits=LogitsPolicy.argmax())
        first = head.logits.argmax()[0]
        with torch.no_grad():
            p = torch.softmax(hf_tiny_llama(torch.tensor([prompt + [first]])).logits[0, -1].double() / temperature, -1)
        x = int(p.argmax())  # the draft: kept with probability p(x), else the residual is drawn
        base, handle, counts, seen = head.kv_cache.sequence_length, head.kv_cache, Counter(), {}
        for seed in range(n):
            out = ex.speculative_decode(first, [x], handle, LogitsPolicy.argmax(),
                                        SpeculativeSampling(temperature=temperature, seed=seed))
            emitted = out.accepted_token_ids[0] if out.accepted_token_ids else out.next_token_id
            assert out.kv_cache.sequence_length == base + 1 + len(out.accepted_token_ids)
            counts[emitted] += 1
            seen[seed] = (out.accepted_token_ids, out.next_token_id)
            handle = ex.truncate_kv(out.kv_cache, base)
        for token in {x} | {int(t) for t in torch.nonzero(p > 0.05).flatten()}:
            sigma = math.sqrt(p[token] * (1 - p[token]) / n)
            assert abs(counts[token] / n - p[token]) < 4.5 * sigma, (token, counts[token] / n, float(p[token]))
        again = ex.speculative_decode(first, [x], handle, LogitsPolicy.argmax(),
                                      SpeculativeSampling(temperature=temperature, seed=7))
        assert (again.accepted_token_ids, again.next_token_id) == seen[7]
        handle = ex.truncate_kv(again.kv_cache, base)
        greedy = list(generate_ids(ex, prompt, 4, SamplingParams(greedy=True)))
        top1 = ex.speculative_decode(first, greedy[1:3], handle, LogitsPolicy.argmax(),
                                     SpeculativeSampling(temperature=1.0, top_k=1, seed=1))
        assert top1.accepted_token_ids == tuple(greedy[1:3]) and top1.next_token_id == greedy[3]
