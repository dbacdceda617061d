"""Caller-chosen sequence names (``request_id``), kept by :class:`~.blocks.BlockManager`.

A name is unique among its tenant's live sequences.  A Prefill bringing a name that
a live sequence has is a retry when the same prompt (the same tokens and adapter:
the sequence's ``prompt_key``) made that sequence, and is answered with it; any
other prompt is refused.  A name released while no live sequence had it is
remembered for :data:`RELEASED_NAME_S`, so that the call bringing it later (one its
caller gave up on) fails CANCELLED instead of making a sequence nobody holds.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict
from typing import Sequence

from ferrum_rpc.errors import Cancelled, RequestIdBusy, RequestIdTaken, shown

from .sequence import SequenceState

RELEASED_NAME_S = 600.0  # how long a request_id released before its sequence existed stays refused
_RELEASED_NAMES = 100_000  # at most this many such names remembered (the oldest forgotten first)


class Names:
    """The names of one block manager's live sequences (``seqs``, its own table, read
    only) and the names released before any sequence had them."""

    def __init__(self, seqs: dict[str, SequenceState]):
        self._seqs = seqs
        self._named: dict[tuple[str, str], str] = {}  # (tenant, request_id) -> cache id of a live sequence
        # (tenant, request_id) released while no sequence had it -> when: a call bringing it later is refused
        self._released_names: OrderedDict[tuple[str, str], float] = OrderedDict()

    def add(self, tenant: str, name: str, cache_id: str) -> None:
        """``cache_id`` is now the tenant's live sequence named ``name`` (checked first)."""
        self.check_name(tenant, name)
        self._named[(tenant, name)] = cache_id

    def drop(self, tenant: str, name: str) -> None:
        """The sequence named ``name`` is gone."""
        del self._named[(tenant, name)]

    def named(self, tenant: str, name: str) -> SequenceState | None:
        """The live sequence ``tenant`` named ``name``, if any."""
        cache_id = self._named.get((tenant, name))
        return None if cache_id is None else self._seqs[cache_id]

    def check_name(self, tenant: str, name: str, prompt_key: bytes = b"",
                   now: float | None = None) -> SequenceState | None:
        """The tenant's live sequence named ``name`` when the prompt ``prompt_key`` made
        it (a retry of the call that made it), else None when the name is free.  Raises
        REQUEST_ID_TAKEN when another prompt's sequence has the name, RequestIdBusy when
        a call is still making its sequence (its outcome is not known yet), and
        CANCELLED when its caller released it before any sequence had it."""
        live = self.named(tenant, name)
        if live is not None:
            if live.pins and not live.prompt_spans:  # its Prefill has not ended: pinned, no prompt yet
                raise RequestIdBusy(f"request_id {shown(name)}: an earlier call is still making its sequence")
            if prompt_key and live.prompt_key == prompt_key:
                return live
            raise RequestIdTaken(f"request_id {shown(name)} already names a live sequence of yours that another "
                                 "prompt (other tokens or another adapter) made; request ids are unique among a "
                                 "tenant's live sequences")
        released = self._released_names.get((tenant, name))
        if released is not None and (time.monotonic() if now is None else now) - released < RELEASED_NAME_S:
            raise Cancelled(f"request_id {shown(name)} was released by its caller before this call ran; "
                            "nothing was done")
        return None

    def release_name(self, tenant: str, name: str, now: float | None = None) -> None:
        """Remembers that ``tenant`` released ``name`` while no live sequence had it."""
        now = time.monotonic() if now is None else now
        self._released_names[(tenant, name)] = now
        self._released_names.move_to_end((tenant, name))
        while self._released_names and (len(self._released_names) > _RELEASED_NAMES
                                        or now - next(iter(self._released_names.values())) >= RELEASED_NAME_S):
            self._released_names.popitem(last=False)


def prompt_key(token_ids: Sequence[int], adapter: str) -> bytes:
    """What tells a retried Prefill from another prompt under the same name: BLAKE2b-128
    of the adapter's name and the token ids (uint32, in this machine's byte order)."""
    h = hashlib.blake2b(adapter.encode() + b"\x00", digest_size=16)
    h.update(array("I", token_ids).tobytes())
    return h.digest()
