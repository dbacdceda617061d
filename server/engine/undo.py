"""Undo records: what a call that is abandoned (failed, cancelled, its reply never sent)
applies to put the sequence it changed back as it was."""

from __future__ import annotations

from dataclasses import dataclass

from ferrum_rpc.types import KvCacheHandle


@dataclass(frozen=True)
class Undo:
    """What puts one sequence back as it was before one call: the one undo record.

    The executor makes it where a call changes a sequence (:meth:`of` for a
    finished call, from the handle the call was given and the one it returned;
    ``Opened.undo_record`` for a call in progress); whoever abandons the call (a
    failure, a caller that went away, a reply never sent) applies it with
    :meth:`TorchExecutor.undo`.  A sequence already gone is skipped."""

    cache_id: str
    back_to: int | None  # the length to go back to; None: the call created the sequence, which is released
    left_at: int | None = None  # the length the call left it at: skipped if something moved it since (None: no check)
    clock: float | None = None  # its idle clock before the call, put back too (None: left as it is)
    # the sequence's change count the call left it at: skipped if any later call changed
    # it, even back to the same length (None: no check)
    left_change: int | None = None

    @classmethod
    def of(cls, before: KvCacheHandle | None, after: KvCacheHandle) -> Undo:
        """Undoes a finished call given ``before`` (None: the call created the sequence)
        that returned ``after``."""
        return cls(after.cache_id, None if before is None else before.sequence_length, after.sequence_length,
                   left_change=after.change)
