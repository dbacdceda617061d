"""Undo ledgers for streaming calls: results that stand only once their replies are out.

A failed or cancelled call changes no state; for a stream that means a result
whose reply never reached gRPC is undone when the call ends (see ``Undo`` in
the executor).  BatchDecode and BatchPrefill are all or nothing up to their last
reply; a DecodeSession step is confirmed by the caller's next step on its
sequence (see ``session.py``).
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from ferrum_rpc.types import KvCacheHandle
from ..engine.facade import Undo

if TYPE_CHECKING:  # handed in by the servicer
    from ..engine.facade import ModelWorker


class Undelivered:
    """Undo records of results whose replies gRPC has not yet accepted for sending.

    A streaming call registers each result's undo records (see ``Undo``) when
    the result is made and marks them sent once its message is handed to gRPC;
    whatever is left when the call ends (cancelled, disconnected, deadline
    passed, failed) is undone, so a sequence never moves ahead of the last reply
    its caller could have.  HTTP/2 flow control stops accepting messages a caller does not read once
    its window is full."""

    def __init__(self) -> None:
        self._pending: dict[int, tuple[ModelWorker, list[Undo]]] = {}
        self._keys = itertools.count()

    def add(self, worker: ModelWorker, undos: list[Undo]) -> int:
        key = next(self._keys)
        self._pending[key] = (worker, undos)
        return key

    def confirm(self, handles: list[KvCacheHandle]) -> None:
        """The caller shows it holds these handles: results it could only have learnt
        from a reply are its own now (a DecodeSession's next step on a sequence)."""
        held = {h.cache_id: h.sequence_length for h in handles}
        for key, (_, undos) in list(self._pending.items()):
            if all(u.cache_id in held and u.left_at is not None and u.left_at <= held[u.cache_id] for u in undos):
                del self._pending[key]

    def keep(self) -> None:
        """The call has handed every reply to gRPC and ends OK: its results stand.

        gRPC's asyncio server does not tell a handler that its caller cancelled once
        the last reply is out (``context.cancelled()`` only reports a status the
        server set itself), so "delivered" means handed to gRPC: a cancel that
        arrives while the replies are still on their way changes nothing."""
        self._pending.clear()

    def drop(self, key: int) -> None:
        """Forgets an entry a later one of the same call covers (decoding ahead keeps one
        per sequence, from where the call found it to where it is now)."""
        self._pending.pop(key, None)

    def abandon(self, keys) -> None:
        """Undoes these entries now (a result whose reply became an error)."""
        rest, self._pending = self._pending, {k: self._pending[k] for k in keys if k in self._pending}
        self.abandon_rest()
        self._pending = {k: v for k, v in rest.items() if k not in keys}

    def abandon_rest(self) -> None:
        by_worker: dict[int, tuple[ModelWorker, list[Undo]]] = {}
        for worker, undos in self._pending.values():
            by_worker.setdefault(id(worker), (worker, []))[1].extend(undos)
        self._pending.clear()
        for worker, undos in by_worker.values():
            worker.undo(undos, "results whose replies were never sent (the call ended first)")
