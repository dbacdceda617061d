"""Token ids checked on the caller's side before they reach the wire."""

from __future__ import annotations

from typing import Iterable

from ferrum_rpc.errors import InvalidInput

_UINT32 = 1 << 32


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
