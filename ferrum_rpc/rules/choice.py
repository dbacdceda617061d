"""Rules for the tokens a request carries and how a token is chosen:

- token ids: integers in the wire's uint32 range (the server also bounds them by its
  vocabulary, :func:`ferrum_rpc.rules.requests.check_tokens`);
- a token-choice policy's ranges, logit bias and allowed-token bitmask;
- the bitmask's layout (little-endian int32 words, bit i of word j for token 32*j + i)."""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.types import MAX_TOP_LOGPROBS, LogprobsMode, TokenChoice

_UINT32 = 1 << 32  # the wire's token ids are uint32
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound; exp(-200) is 0 in float32, so +-100 forces or bans any token
MAX_PENALTY = 2.0  # presence and frequency, OpenAI's range


# ---------------------------------------------------------------------------- validation

def validate_token_choice(choice: TokenChoice, vocab_size: int | None, field: str = "token_choice") -> None:
    """Raises InvalidInput naming the first bad field of ``choice`` (``field`` prefixes
    the name, e.g. "items[3].token_choice"). The server calls it before any state
    changes; a client calls it before the request goes out (``vocab_size`` None: the
    checks that need the vocabulary are the server's).

    Args:
        choice: the policy.
        vocab_size: the model's vocabulary (the width of a logits row), or None.
        field: how the message names the policy.
    """
    _check_range(choice, field)
    _check_bias(choice.logit_bias, vocab_size, field)
    if choice.allowed_token_bitmask and vocab_size is not None:
        _check_bitmask(choice.allowed_token_bitmask, vocab_size, field)


def _check_range(c: TokenChoice, field: str) -> None:
    def bad(name: str, rule: str, value) -> InvalidInput:
        return InvalidInput(f"{field}.{name} must be {rule}, got {value!r}")

    if not (math.isfinite(c.temperature) and c.temperature >= 0):
        raise bad("temperature", "finite and >= 0 (0: greedy)", c.temperature)
    if not (isinstance(c.top_k, int) and c.top_k >= 0):
        raise bad("top_k", "an integer >= 0 (0: off)", c.top_k)
    if not 0 < c.top_p <= 1:  # NaN fails too
        raise bad("top_p", "in (0, 1] (1: off)", c.top_p)
    if not 0 <= c.min_p <= 1:
        raise bad("min_p", "in [0, 1] (0: off)", c.min_p)
    if c.seed is not None and not (isinstance(c.seed, int) and 0 <= c.seed < 1 << 64):
        raise bad("seed", "an unsigned 64-bit integer", c.seed)
    if not (math.isfinite(c.repetition_penalty) and c.repetition_penalty > 0):
        raise bad("repetition_penalty", "finite and > 0 (1: off)", c.repetition_penalty)
    for name in ("presence_penalty", "frequency_penalty"):
        if not -MAX_PENALTY <= getattr(c, name) <= MAX_PENALTY:
            raise bad(name, f"in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", getattr(c, name))
    if not (isinstance(c.top_logprobs, int) and 0 <= c.top_logprobs <= MAX_TOP_LOGPROBS):
        raise bad("top_logprobs", f"in 0 ..= {MAX_TOP_LOGPROBS}", c.top_logprobs)
    if not isinstance(c.logprobs_mode, LogprobsMode):
        raise bad("logprobs_mode", "RAW or PROCESSED", c.logprobs_mode)


def _check_bias(bias, vocab_size: int | None, field: str) -> None:
    for token, value in bias.items():
        if not (isinstance(token, (int, np.integer)) and 0 <= token < (_UINT32 if vocab_size is None else vocab_size)):
            raise InvalidInput(f"{field}.logit_bias names token {token!r}, outside the vocabulary "
                               f"(0 ..= {(_UINT32 if vocab_size is None else vocab_size) - 1})")
        if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
            raise InvalidInput(f"{field}.logit_bias[{token}] must be finite and in "
                               f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")


def _check_bitmask(mask: bytes, vocab_size: int, field: str) -> None:
    words = -(-vocab_size // 32)
    if len(mask) != 4 * words:
        raise InvalidInput(f"{field}.allowed_token_bitmask must be ceil({vocab_size} / 32) = {words} int32 words "
                           f"({4 * words} bytes), got {len(mask)} bytes")
    if not _allows_any(mask, vocab_size):
        raise InvalidInput(f"{field}.allowed_token_bitmask allows no token of the {vocab_size}")


# ---------------------------------------------------------------------------- bitmask

def pack_allowed_tokens(token_ids, vocab_size: int) -> bytes:
    """The bitmask allowing exactly ``token_ids``: little-endian int32 words, bit i of
    word j for token 32*j + i (the layout xgrammar's ``allocate_token_bitmask`` and
    llguidance's ``compute_bitmask`` produce)."""
    bits = np.zeros(-(-vocab_size // 32) * 32, dtype=np.uint8)
    bits[np.asarray(list(token_ids), dtype=np.int64)] = 1
    return np.packbits(bits, bitorder="little").tobytes()


def unpack_allowed_tokens(mask: bytes, vocab_size: int) -> np.ndarray:
    """(vocab_size,) bool: which tokens ``mask`` allows (bits past the vocabulary ignored)."""
    return np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[:vocab_size].astype(bool)


def _allows_any(mask: bytes, vocab_size: int) -> bool:
    """Whether ``mask`` allows any token of the vocabulary, read on the bytes (no unpacking:
    the server checks every step's mask)."""
    full, rest = divmod(vocab_size, 8)
    data = np.frombuffer(mask, dtype=np.uint8)
    return bool(data[:full].any()) or bool(rest and data[full] & ((1 << rest) - 1))


def allows(mask: bytes, token: int) -> bool:
    """Whether ``mask`` allows ``token`` (a bit test on the bytes: bit t % 8 of byte
    t // 8, the little-endian words' layout), for a token inside the vocabulary."""
    return bool(mask[token >> 3] >> (token & 7) & 1)


# ---------------------------------------------------------------------------- token ids

def checked_ids(field: str, ids: Iterable[int]) -> list[int]:
    """``ids`` as the wire's uint32 token ids, refused before the wire with
    INVALID_INPUT naming ``field`` when one is not an integer in 0..2**32-1
    (protobuf would raise a bare ValueError, or silently wrap a numpy value)."""
    out = list(ids)
    for i, t in enumerate(out):
        if isinstance(t, bool) or not hasattr(t, "__index__"):
            raise InvalidInput(f"{field}[{i}] must be an integer token id, got {t!r}")
        if not 0 <= int(t) < _UINT32:
            raise InvalidInput(f"{field}[{i}] must be a token id >= 0, got {int(t)}")
    return [int(t) for t in out]


def checked_id(field: str, token_id: int) -> int:
    """One token id, checked as :func:`checked_ids` checks each."""
    if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
        raise InvalidInput(f"{field} must be an integer token id, got {token_id!r}")
    if not 0 <= int(token_id) < _UINT32:
        raise InvalidInput(f"{field} must be a token id >= 0, got {int(token_id)}")
    return int(token_id)
