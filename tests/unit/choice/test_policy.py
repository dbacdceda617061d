"""ferrum_rpc/rules.py (the token-choice rules server and clients share): one validation test per bad input (the message names the
field), the allowed-token bitmask's documented layout, and a real grammar library's
bitmask (llguidance, a JSON schema) never violated by the tokens choose_tokens picks."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.rules import pack_allowed_tokens, unpack_allowed_tokens, validate_token_choice
from ferrum_rpc.server.choice.sampling import choose_tokens
from ferrum_rpc.types import TokenChoice
from tests.unit.choice.test_sampling import WARPED


# ---------------------------------------------------------------------------- a real grammar's bitmask

GRAMMAR_TOKENS = [b"<eos>", b"{", b"}", b'"', b"a", b"b", b":", b",", b"0", b"1", b"2", b" ", b"true", b"false",
                  b"[", b"]", b'"a"', b"null", b"12", b"x"] + [bytes([c]) for c in b"cdefghijklmnopqrstuvwyz"] \
                 + [b"ab", b"ba", b"aa", b"bb", b"10", b"21", b"}}", b"{{", b"::", b",,", b"01"]


class _TinyTokenizer:
    """A 58-token vocabulary (two bitmask words) for llguidance's TokenizerWrapper."""

    eos_token_id = 0
    bos_token_id = None
    tokens = GRAMMAR_TOKENS
    special_token_ids = [0]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        return [GRAMMAR_TOKENS.index(bytes([b])) for b in data if bytes([b]) in GRAMMAR_TOKENS]


@pytest.mark.parametrize("seed", range(6))
def test_llguidance_json_mask_is_never_violated(seed):
    llguidance = pytest.importorskip("llguidance")
    vocab = len(GRAMMAR_TOKENS)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TinyTokenizer()))
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}},
              "required": ["a", "b"], "additionalProperties": False}
    matcher = llguidance.LLMatcher(tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema)),
                                   log_level=0)
    generator = torch.Generator().manual_seed(seed)
    text, policy = [], TokenChoice(temperature=1.5, seed=seed, repetition_penalty=1.1) if seed % 2 else \
        TokenChoice(temperature=0.0)
    for position in range(200):
        if matcher.is_stopped():
            break
        mask = matcher.compute_bitmask()
        allowed = unpack_allowed_tokens(mask, vocab)
        assert allowed.tolist() == [matcher.validate_tokens([t]) == 1 for t in range(vocab)]  # the layout
        logits = torch.randn(1, vocab, generator=generator) * 3
        logits[0, 0] -= 4  # the end only when a random walk would choose it
        choice = TokenChoice(**{**policy.__dict__, "allowed_token_bitmask": mask})
        validate_token_choice(choice, vocab)
        token = choose_tokens(logits, [choice], [position], [[]], [text]).row(0).token_id
        assert allowed[token], f"chose disallowed token {GRAMMAR_TOKENS[token]!r}"
        assert matcher.consume_token(token), matcher.get_error()
        text.append(token)
    assert matcher.is_stopped() and not matcher.is_error()
    document = b"".join(GRAMMAR_TOKENS[t] for t in text if t != 0)
    assert set(json.loads(document)) == {"a", "b"}


def test_pack_and_unpack_agree_with_the_documented_layout():
    mask = pack_allowed_tokens([0, 31, 32, 69], 70)
    words = np.frombuffer(mask, dtype="<i4")
    assert len(words) == 3 and words[0] == np.int32(-2147483647) and words[1] == 1 and words[2] == 1 << 5
    assert np.flatnonzero(unpack_allowed_tokens(mask, 70)).tolist() == [0, 31, 32, 69]


# ---------------------------------------------------------------------------- validation

@pytest.mark.parametrize("choice, message", [
    (TokenChoice(temperature=math.nan), "token_choice.temperature must be finite and >= 0"),
    (TokenChoice(temperature=-0.5), "token_choice.temperature must be finite and >= 0"),
    (TokenChoice(temperature=math.inf), "token_choice.temperature must be finite and >= 0"),
    (TokenChoice(top_p=0.0), "token_choice.top_p must be in (0, 1]"),
    (TokenChoice(top_p=1.5), "token_choice.top_p must be in (0, 1]"),
    (TokenChoice(top_p=math.nan), "token_choice.top_p must be in (0, 1]"),
    (TokenChoice(min_p=-0.1), "token_choice.min_p must be in [0, 1]"),
    (TokenChoice(min_p=1.01), "token_choice.min_p must be in [0, 1]"),
    (TokenChoice(top_k=-1), "token_choice.top_k must be an integer >= 0"),
    (TokenChoice(repetition_penalty=0.0), "token_choice.repetition_penalty must be finite and > 0"),
    (TokenChoice(repetition_penalty=-1.0), "token_choice.repetition_penalty must be finite and > 0"),
    (TokenChoice(repetition_penalty=math.inf), "token_choice.repetition_penalty must be finite and > 0"),
    (TokenChoice(presence_penalty=2.5), "token_choice.presence_penalty must be in [-2, 2]"),
    (TokenChoice(frequency_penalty=-2.01), "token_choice.frequency_penalty must be in [-2, 2]"),
    (TokenChoice(frequency_penalty=math.nan), "token_choice.frequency_penalty must be in [-2, 2]"),
    (TokenChoice(top_logprobs=21), "token_choice.top_logprobs must be in 0 ..= 20"),
    (TokenChoice(top_logprobs=-1), "token_choice.top_logprobs must be in 0 ..= 20"),
    (TokenChoice(seed=-1), "token_choice.seed must be an unsigned 64-bit integer"),
    (TokenChoice(seed=2**64), "token_choice.seed must be an unsigned 64-bit integer"),
    (TokenChoice(logit_bias={70: 1.0}), "token_choice.logit_bias names token 70, outside the vocabulary (0 ..= 69)"),
    (TokenChoice(logit_bias={-1: 1.0}), "token_choice.logit_bias names token -1, outside the vocabulary"),
    (TokenChoice(logit_bias={3: math.inf}), "token_choice.logit_bias[3] must be finite and in [-100, 100]"),
    (TokenChoice(logit_bias={3: math.nan}), "token_choice.logit_bias[3] must be finite and in [-100, 100]"),
    (TokenChoice(logit_bias={3: -100.5}), "token_choice.logit_bias[3] must be finite and in [-100, 100]"),
    (TokenChoice(allowed_token_bitmask=b"\xff" * 8),
     "token_choice.allowed_token_bitmask must be ceil(70 / 32) = 3 int32 words (12 bytes), got 8 bytes"),
    (TokenChoice(allowed_token_bitmask=b"\xff" * 13), "must be ceil(70 / 32) = 3 int32 words (12 bytes), got 13"),
    (TokenChoice(allowed_token_bitmask=bytes(12)), "token_choice.allowed_token_bitmask allows no token of the 70"),
    (TokenChoice(allowed_token_bitmask=bytes(8) + b"\x00\x00\x00\xff"),  # bits past the vocabulary only
     "token_choice.allowed_token_bitmask allows no token of the 70"),
])
def test_each_bad_input_is_refused_with_a_precise_message(choice, message):
    with pytest.raises(InvalidInput) as raised:
        validate_token_choice(choice, 70)
    assert message in raised.value.message


def test_the_message_names_the_item():
    with pytest.raises(InvalidInput, match=r"items\[3\]\.token_choice\.top_p"):
        validate_token_choice(TokenChoice(top_p=2.0), 70, field="items[3].token_choice")


def test_good_policies_pass():
    for choice in WARPED + [TokenChoice(seed=0), TokenChoice(seed=2**64 - 1), TokenChoice(top_logprobs=20),
                            TokenChoice(logit_bias={0: -100.0, 69: 100.0}, presence_penalty=-2.0),
                            TokenChoice(allowed_token_bitmask=pack_allowed_tokens([69], 70)),
                            TokenChoice(top_k=10_000)]:
        validate_token_choice(choice, 70)


def test_a_bitmask_allowing_only_bits_past_the_vocabulary_allows_no_token():
    """The check reads the mask's bytes: a bit in the last, partial byte inside the
    vocabulary counts; one past the vocabulary does not."""
    vocab = 100  # 4 words: bits 100..127 lie past it
    validate_token_choice(TokenChoice(allowed_token_bitmask=pack_allowed_tokens([99], vocab)), vocab)
    validate_token_choice(TokenChoice(allowed_token_bitmask=pack_allowed_tokens([96], vocab)), vocab)
    past = bytearray(16)
    past[12] = 0b0001_0000  # token 100
    with pytest.raises(InvalidInput, match="allows no token"):
        validate_token_choice(TokenChoice(allowed_token_bitmask=bytes(past)), vocab)
