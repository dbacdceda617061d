"""A validated call's sequence, opened: what the call changes and what puts it back."""

from __future__ import annotations

from dataclasses import dataclass

from .undo import Undo
from ..kv.blocks import SequenceState


@dataclass
class Opened:
    """A validated call's sequence and what is needed to put it back as it was."""

    seq: SequenceState
    created: bool  # the call made the sequence: a failure forgets it
    cached: int  # prompt tokens served from the prefix cache
    origin: int  # the sequence's length before the call
    clock: float  # its idle clock before the call (a failure leaves it untouched)

    @property
    def undo_record(self) -> Undo:
        """The record that puts the sequence back as it was before the call, idle clock included."""
        return Undo(self.seq.cache_id, None if self.created else self.origin, clock=self.clock)
