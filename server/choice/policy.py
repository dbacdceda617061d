"""A token-choice policy's checks and the allowed-token bitmask's layout: what a request
may ask of the server's token choice, refused with the field named before any state
changes.  No torch (numpy for the bitmask), so any layer may call it."""

from __future__ import annotations

import math
import threading
from collections import OrderedDict

import numpy as np

from ferrum_rpc.errors import InvalidInput
from ferrum_rpc.types import MAX_TOP_LOGPROBS, LogprobsMode, TokenChoice

MAX_LOGIT_BIAS = 100.0  # OpenAI's bound; exp(-200) is 0 in float32, so +-100 forces or bans any token
MAX_PENALTY = 2.0  # presence and frequency, OpenAI's range


# ---------------------------------------------------------------------------- validation

def validate_token_choice(choice: TokenChoice, vocab_size: int, field: str = "token_choice") -> None:
    """Raises InvalidInput naming the first bad field of ``choice`` (``field`` prefixes
    the name, e.g. "items[3].token_choice"). Call it before any state changes.

    Args:
        choice: the policy.
        vocab_size: the model's vocabulary (the width of a logits row).
        field: how the message names the policy.
    """
    _check_range(choice, field)
    _check_bias(choice.logit_bias, vocab_size, field)
    if choice.allowed_token_bitmask:
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


def _check_bias(bias, vocab_size: int, field: str) -> None:
    for token, value in bias.items():
        if not (isinstance(token, (int, np.integer)) and 0 <= token < vocab_size):
            raise InvalidInput(f"{field}.logit_bias names token {token!r}, outside the vocabulary "
                               f"(0 ..= {vocab_size - 1})")
        if not (math.isfinite(value) and abs(value) <= MAX_LOGIT_BIAS):
            raise InvalidInput(f"{field}.logit_bias[{token}] must be finite and in "
                               f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {value!r}")


def _check_bitmask(mask: bytes, vocab_size: int, field: str) -> None:
    words = -(-vocab_size // 32)
    if len(mask) != 4 * words:
        raise InvalidInput(f"{field}.allowed_token_bitmask must be ceil({vocab_size} / 32) = {words} int32 words "
                           f"({4 * words} bytes), got {len(mask)} bytes")
    if not allowed_tokens(mask, vocab_size).any():
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


# A request's bitmask is the same bytes every step (a grammar state, a fixed set of banned
# tokens), so its unpacked form is kept: the last _ALLOWED_KEPT distinct masks, keyed by
# (vocab_size, the bytes themselves): Python hashes a bytes object once and a hit is
# confirmed by comparing the bytes, so two masks never share an entry.
_ALLOWED_KEPT = 64
_allowed: OrderedDict[tuple[int, bytes], np.ndarray] = OrderedDict()
_allowed_lock = threading.Lock()


def allowed_tokens(mask: bytes, vocab_size: int) -> np.ndarray:
    """:func:`unpack_allowed_tokens`, kept for the last few distinct masks.  The array is
    shared between callers: read it, never write it."""
    key = (vocab_size, bytes(mask))
    with _allowed_lock:
        got = _allowed.get(key)
        if got is not None:
            _allowed.move_to_end(key)
            return got
    got = unpack_allowed_tokens(mask, vocab_size)
    with _allowed_lock:
        _allowed[key] = got
        if len(_allowed) > _ALLOWED_KEPT:
            _allowed.popitem(last=False)
    return got


def allows(mask: bytes, token: int) -> bool:
    """Whether ``mask`` allows ``token`` (a bit test on the bytes: bit t % 8 of byte
    t // 8, the little-endian words' layout), for a token inside the vocabulary."""
    return bool(mask[token >> 3] >> (token & 7) & 1)
