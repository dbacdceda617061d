"""The unpacked allowed-token bitmasks the server's token choice reads, kept for the
last few distinct masks (the layout and its checks are ``ferrum_rpc.rules``')."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from ferrum_rpc.rules import unpack_allowed_tokens

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
