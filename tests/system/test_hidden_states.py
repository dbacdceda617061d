"""Analysis outputs through a real server: hidden states of chosen layers at chosen
positions equal transformers' ``output_hidden_states``, and attention weights of
chosen layers and heads its eager ``output_attentions`` (float32, 1e-4), for Llama
and Qwen3, over chunked prompts and continuations; bad requests change nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, InvalidInput, LogitsPolicy
from ferrum_rpc.types import HiddenStatesRequest
from tests.conftest import running_server

ATOL = 1e-4
PROMPT = [5, 9, 13, 2, 77, 31, 8, 100, 4, 6, 250, 17, 3]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def case(request, tiny_llama_dir, tiny_qwen3_dir):
    from transformers import AutoModelForCausalLM

    path = tiny_llama_dir if request.param == "llama" else tiny_qwen3_dir
    oracle = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with running_server(path, prefill_chunk=5) as server:  # the 13-token prompt runs in 3 chunks
        yield server, oracle


def oracle_states(oracle, ids: list[int]) -> list[np.ndarray]:
    with torch.no_grad():
        out = oracle(torch.tensor([ids]), output_hidden_states=True)
    return [h[0].numpy() for h in out.hidden_states]


def test_hidden_states_equal_transformers(case):
    server, oracle = case
    layers = oracle.config.num_hidden_layers
    expected = oracle_states(oracle, PROMPT)
    with ExecutorClient(server.target, timeout=30) as ex:
        ask = HiddenStatesRequest(layers=tuple(range(layers + 1)))
        out = ex.prefill(PROMPT, logits=LogitsPolicy.argmax(), hidden_states=ask)
        assert len(out.hidden_states) == layers + 1
        for layer, got in enumerate(out.hidden_states):
            assert got.shape == (len(PROMPT), oracle.config.hidden_size)
            np.testing.assert_allclose(got, expected[layer], atol=ATOL, rtol=0, err_msg=f"layer {layer}")
        # chosen layers and positions, in the order asked; a continuation's positions are its own
        more = [40, 41, 42]
        cont = ex.prefill(more, out.kv_cache, hidden_states=HiddenStatesRequest(layers=(layers, 1), positions=(2, 0)))
        full = oracle_states(oracle, PROMPT + more)
        np.testing.assert_allclose(cont.hidden_states[0], full[layers][[len(PROMPT) + 2, len(PROMPT)]], atol=ATOL,
                                   rtol=0)
        np.testing.assert_allclose(cont.hidden_states[1], full[1][[len(PROMPT) + 2, len(PROMPT)]], atol=ATOL, rtol=0)
        assert ex.decode(1, cont.kv_cache).kv_cache.sequence_length == len(PROMPT) + 4
        ex.release_cache(cont.kv_cache)


def oracle_attention(oracle, ids: list[int]) -> list[np.ndarray]:
    """transformers' eager attention weights per layer: (heads, T, T)."""
    oracle.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = oracle(torch.tensor([ids]), output_attentions=True)
    finally:
        oracle.set_attn_implementation("sdpa")
    return [a[0].numpy() for a in out.attentions]


def test_attention_weights_equal_transformers(case):
    server, oracle = case
    layers, heads = oracle.config.num_hidden_layers, oracle.config.num_attention_heads
    expected = oracle_attention(oracle, PROMPT)
    with ExecutorClient(server.target, timeout=30) as ex:
        # every layer and head, over a 3-chunk prompt, with hidden states beside them
        ask = HiddenStatesRequest(layers=(1,), attention_layers=tuple(range(layers)))
        out = ex.prefill(PROMPT, logits=LogitsPolicy.argmax(), hidden_states=ask)
        assert len(out.attention_weights) == layers and len(out.hidden_states) == 1
        for layer, got in enumerate(out.attention_weights):
            assert got.shape == (heads, len(PROMPT), len(PROMPT))
            np.testing.assert_allclose(got, expected[layer], atol=ATOL, rtol=0, err_msg=f"layer {layer}")
        np.testing.assert_allclose(out.attention_weights[0].sum(-1), 1.0, atol=1e-5)
        # a continuation: chosen heads and positions, over every key of the sequence
        more = [40, 41, 42]
        ask = HiddenStatesRequest(positions=(2, 0), attention_layers=(layers - 1,), attention_heads=(3, 0))
        cont = ex.prefill(more, out.kv_cache, hidden_states=ask)
        (got,) = cont.attention_weights
        full = oracle_attention(oracle, PROMPT + more)[layers - 1]
        want = full[[3, 0]][:, [len(PROMPT) + 2, len(PROMPT)]]  # (heads, positions, keys)
        assert got.shape == (2, 2, len(PROMPT) + 3)
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)
        ex.release_cache(cont.kv_cache)


def test_attention_weights_over_the_message_limit_are_refused_up_front(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_message_bytes=64 * 1024) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        with pytest.raises(InvalidInput, match="message limit"):  # 2 layers x 4 heads x 50 x 50 x 4 bytes
            ex.prefill(list(range(1, 51)), hidden_states=HiddenStatesRequest(attention_layers=(0, 1)))
        out = ex.prefill(list(range(1, 51)), hidden_states=HiddenStatesRequest(attention_layers=(0,),
                                                                               attention_heads=(1,)))
        assert out.attention_weights[0].shape == (1, 50, 50)
        ex.release_cache(out.kv_cache)
        assert ex.status().active_sequences == 0


def test_bad_hidden_state_requests_change_nothing(case):
    server, oracle = case
    with ExecutorClient(server.target, timeout=30) as ex:
        before = (ex.status().active_sequences, ex.status().kv_blocks_used)
        for ask, why in [(HiddenStatesRequest(layers=()), "asks for nothing"),
                         (HiddenStatesRequest(attention_layers=(oracle.config.num_hidden_layers,)),
                          "attention_layers must be"),
                         (HiddenStatesRequest(attention_layers=(0,), attention_heads=(4,)), "attention_heads must be"),
                         (HiddenStatesRequest(layers=(0,), attention_heads=(0,)), "needs attention_layers"),
                         (HiddenStatesRequest(layers=(oracle.config.num_hidden_layers + 1,)), "layers must be"),
                         (HiddenStatesRequest(layers=(0,), positions=(len(PROMPT),)), "positions must be")]:
            with pytest.raises(InvalidInput, match=why):
                ex.prefill(PROMPT, hidden_states=ask)
        assert (ex.status().active_sequences, ex.status().kv_blocks_used) == before


def test_hidden_states_over_the_message_limit_are_refused_up_front(tiny_llama_dir):
    with running_server(tiny_llama_dir, max_message_bytes=64 * 1024) as server, \
            ExecutorClient(server.target, timeout=30) as ex:
        with pytest.raises(InvalidInput, match="message limit"):
            ex.prefill(list(range(1, 200)), logits=LogitsPolicy.argmax(),
                       hidden_states=HiddenStatesRequest(layers=(0, 1, 2)))
        assert ex.status().active_sequences == 0
