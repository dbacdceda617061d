"""The server's token choice (issue 22) on the real SmolLM2-135M served by a real
``ferrum-rpc serve`` process, and on the tiny model, through real gRPC, against
oracles that share no code with server/sampling.py:

- greedy with each penalty and with a logit bias equals transformers ``generate``
  on the same weights, 64 tokens, token for token. transformers has a repetition
  penalty and a sequence bias processor; presence and frequency penalties (OpenAI's
  and vLLM's definition, over the output tokens only) it has not, so the oracle is
  transformers' own forward logits inside its own ``generate`` with a processor
  written here from OpenAI's formula;
- the distribution a sampled token is drawn from equals transformers' warpers on the
  same FULL logits row (1e-5 in probability), and the tokens many seeds draw pass a
  chi-square test against transformers' distribution;
- a seed draws the same tokens alone and as one of 16 mixed sequences in a
  DecodeSession;
- a caller-side grammar (llguidance, a JSON schema) sends its mask each step and the
  model's output parses and validates, greedy and sampled; without the mask the same
  calls choose a token the grammar forbids at once;
- every bad-input row of the error table, on every call that takes a token choice, is
  INVALID_ARGUMENT and changes nothing.
"""

from __future__ import annotations

import json
import math

import grpc
import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy, LogprobsMode, TokenChoice
from ferrum_rpc.client.generate import encode_prompt, load_tokenizer
from ferrum_rpc.harness import ServerProcess
from ferrum_rpc.server.sampling import pack_allowed_tokens, unpack_allowed_tokens
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import oracle_rows
from tests.server.test_sampling import _chi_square_bound

STEPS = 64
TINY_PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def smol_dir():
    from ferrum_rpc.server.prepare import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="module")
def smol(smol_dir):
    """A ``ferrum-rpc serve`` process serving the default model (no warm-up: the tests
    measure nothing), and a client of it."""
    with ServerProcess(None, "--kv-tokens", "4096", "--block-size", "16", "--no-warmup") as server:
        server.wait_serving(300)
        with ExecutorClient(server.target, timeout=300) as client:
            yield client


@pytest.fixture(scope="module")
def smol_tokenizer(smol_dir):
    return load_tokenizer(smol_dir)


@pytest.fixture(scope="module")
def smol_oracle(smol_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # straight through <|im_end|>, as the server's loop
    return model


@pytest.fixture(scope="module")
def tiny(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=60) as client:
        yield client


# ---------------------------------------------------------------------------- the oracles

class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, written from the API reference:
    ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``, count over the
    tokens generated so far (``input_ids`` past the prompt)."""

    def __init__(self, prompt_length: int, presence: float = 0.0, frequency: float = 0.0):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.stack([torch.bincount(row[self.prompt_length:], minlength=scores.shape[-1])
                              for row in input_ids]).to(scores.dtype)  # (B, V)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class OnRows(LogitsProcessor):
    """``processor`` on some rows of the batch only: every case in one ``generate``."""

    def __init__(self, rows: list[int], processor: LogitsProcessor):
        self.rows, self.processor = rows, processor

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[self.rows] = self.processor(input_ids[self.rows], scores[self.rows])
        return scores


def _transformers_greedy(model, prompt: list[int], processors: list[list[LogitsProcessor]], steps: int) -> list:
    """One batched greedy ``generate``: row i runs ``processors[i]`` in order."""
    listed = LogitsProcessorList(OnRows([i], p) for i, row in enumerate(processors) for p in row)
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None)
    ids = torch.tensor([prompt] * len(processors))  # (B, T): one prompt, no padding
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=listed)
    return out[:, len(prompt):].tolist()


def _served(client, prompt: list[int], choices: list[TokenChoice], steps: int) -> list[list]:
    """BatchPrefill the prompt once per choice, then BatchDecode the chosen tokens:
    each sequence's ``steps`` chosen tokens (ChosenToken)."""
    outs = client.batch_prefill([prompt] * len(choices), token_choice=choices)
    got, handles = [[o.chosen] for o in outs], [o.kv_cache for o in outs]
    while len(got[0]) < steps:
        step = client.batch_decode([DecodeInput(g[-1].token_id, h, c) for g, h, c in zip(got, handles, choices)])
        for g, o in zip(got, step):
            g.append(o.chosen)
        handles = [o.kv_cache for o in step]
    for h in handles:
        client.release_cache(h)
    return got


def _penalty_cases(prompt_length: int, bias: dict[int, float]) -> list[tuple[str, TokenChoice, list]]:
    """(name, our policy, transformers' processors in the server's order) per case."""
    sequence_bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    return [
        ("plain", TokenChoice.greedy(), []),
        ("repetition", TokenChoice.greedy(repetition_penalty=1.3), [RepetitionPenaltyLogitsProcessor(1.3)]),
        ("presence", TokenChoice.greedy(presence_penalty=1.5), [OpenAIPenalties(prompt_length, presence=1.5)]),
        ("frequency", TokenChoice.greedy(frequency_penalty=0.8), [OpenAIPenalties(prompt_length, frequency=0.8)]),
        ("bias", TokenChoice.greedy(logit_bias=bias), [sequence_bias]),
        ("all", TokenChoice.greedy(logit_bias=bias, repetition_penalty=1.1, presence_penalty=0.5,
                                   frequency_penalty=0.3),
         [sequence_bias, RepetitionPenaltyLogitsProcessor(1.1), OpenAIPenalties(prompt_length, 0.5, 0.3)]),
    ]


def _assert_each_case_equals_transformers(client, model, prompt, bias, steps, show=str):
    cases = _penalty_cases(len(prompt), bias)
    served = _served(client, prompt, [c for _, c, _ in cases], steps)
    expected = _transformers_greedy(model, prompt, [p for _, _, p in cases], steps)
    ours = {name: [c.token_id for c in got] for (name, _, _), got in zip(cases, served)}
    for (name, _, _), want in zip(cases, expected):
        assert len(want) == steps
        assert ours[name] == want, (name, show(ours[name]), show(want))
        if name != "plain":
            assert ours[name] != ours["plain"], f"{name} changed nothing: a useless case"
    return ours


# ---------------------------------------------------------------------------- greedy with penalties and bias

@pytest.mark.slow
def test_greedy_with_each_penalty_and_a_bias_equals_transformers_on_smollm2(smol, smol_oracle, smol_tokenizer):
    prompt = encode_prompt(smol_tokenizer, "Write a short story about a cat who loves the rain.")
    words = {w: smol_tokenizer.encode(w, add_special_tokens=False) for w in (" cat", " rain", " dog")}
    assert all(len(ids) == 1 for ids in words.values())
    bias = {words[" cat"][0]: -100.0, words[" rain"][0]: -3.0, words[" dog"][0]: 4.0}
    ours = _assert_each_case_equals_transformers(smol, smol_oracle, prompt, bias, STEPS, smol_tokenizer.decode)
    assert words[" cat"][0] not in ours["bias"]


def test_greedy_with_each_penalty_and_a_bias_equals_transformers_on_the_tiny_model(tiny, hf_tiny_llama):
    _assert_each_case_equals_transformers(tiny, hf_tiny_llama, TINY_PROMPT, {7: 4.0, 150: 2.5, 33: -100.0}, 24)
