"""Decoding ahead inside the engine: a run's sequences decode forward after forward on
the worker thread until each stops, and what each forward chose goes out through a
bounded queue.

The worker owns a running :class:`AheadRun`: before each forward it adds the run's
live sequences to the batch (a run holds seats, see ``ModelWorker.start_ahead``, so
they always fit), and after it the run applies its stop rules and queues one entry
for the forward.  No forward waits for the event loop: the caller's side only takes
entries off the queue and sends them.

The queue's bound is the back-pressure: a run whose queue holds ``bound`` entries is
paused (it joins no forward and grows no KV) until its consumer takes one.  The RPC
layer takes an entry only once the reply before it went into the caller's window, so
a caller that stops reading holds its window's worth of replies plus ``bound``
forwards per run.

Who undoes what: while the worker owns the run, a failure, a passed deadline or a
cancel ends it there and puts every sequence back where the run found it (the caller
is told the error, so the run changes nothing).  Once the run has finished, its
tokens stand as far as the engine is concerned; the consumer takes that
responsibility when it takes the last entry, and a cancel that comes before then
undoes the run through the worker's queue instead.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ferrum_rpc.types import DecodeInput, DecodeOutput
from .undo import Undo

QUEUED_FORWARDS = 2  # a run's queue bound by default: one forward being sent while the next runs, and one more


class Finish(enum.Enum):
    """Why a sequence of a run stopped decoding."""
    STOP_TOKEN = "stop_token"  # it chose one of the run's stop tokens (the last token)
    LENGTH = "length"  # it emitted the run's limit
    STOPPED = "stopped"  # the caller asked the run to stop
    MAX_SEQUENCE_LENGTH = "max_sequence_length"  # the sequence is full


@dataclass(frozen=True)
class Emitted:
    """One sequence's token of one forward: its index in the run's items, the output,
    and why it stopped (None: it goes on)."""
    index: int
    out: DecodeOutput
    finish: Finish | None


class _State(enum.Enum):
    RUNNING = 1  # the worker owns it
    FINISHED = 2  # every sequence stopped; its last entry not yet taken
    HANDED = 3  # the consumer took the last entry: its results are the consumer's
    ENDED = 4  # failed or cancelled, and undone


class AheadRun:
    """One decode-ahead run.  Built by ``ModelWorker.start_ahead``; advanced on the worker
    thread; consumed by one reader (``take``), on any thread."""

    def __init__(self, items: list[DecodeInput], limit: int, stop_ids: frozenset[int], max_len: int,
                 tenant: str, deadline: float | None, bound: int, undo: Callable[[list[Undo]], None],
                 wake: Callable[[], None]):
        self.items, self.limit, self.stop_ids, self.max_len = items, limit, stop_ids, max_len
        self.tenant, self.deadline, self.bound = tenant, deadline, bound
        self._undo, self._wake = undo, wake  # apply undo records on the worker's queue; wake the worker
        self.live: list[tuple[int, DecodeInput]] = list(enumerate(items))
        self.emitted = [0] * len(items)
        self.last: list[DecodeOutput | None] = [None] * len(items)
        self.stop_requested = False
        self.cancelled = False
        self._state = _State.RUNNING
        self._lock = threading.Lock()
        self._entries: deque[list[Emitted]] = deque()
        self._error: BaseException | None = None
        self.on_entry: Callable[[], None] = lambda: None  # called (worker thread) after an entry is queued

    # -- the consumer's side ------------------------------------------------------
    def take(self) -> list[Emitted] | None:
        """The next forward's tokens, or None if none is queued yet.  Raises the run's
        error once it failed.  After the last entry, ``done`` is true."""
        entries = self.take_some(1)
        return entries[0] if entries else None

    def take_some(self, limit: int) -> list[list[Emitted]]:
        """Up to ``limit`` queued forwards' tokens, oldest first (empty if none is queued
        yet), as :meth:`take`."""
        with self._lock:
            if self._entries:
                was_full = len(self._entries) >= self.bound
                entries = [self._entries.popleft() for _ in range(min(limit, len(self._entries)))]
                if not self._entries and self._state is _State.FINISHED:
                    self._state = _State.HANDED
            elif self._error is not None:
                raise self._error
            else:
                return []
        if was_full:
            self._wake()  # a paused run may join the next forward
        return entries

    @property
    def queued(self) -> int:
        """Forwards whose tokens wait for the consumer."""
        return len(self._entries)

    @property
    def done(self) -> bool:
        """The consumer took the run's last entry."""
        return self._state is _State.HANDED

    def stop(self) -> None:
        """Asks the run to stop: each sequence ends with STOPPED after the forward it is in."""
        self.stop_requested = True

    def cancel(self) -> None:
        """The consumer went away: the run changes nothing.  A running run is ended and
        undone by the worker before its next forward; a finished one whose last entry
        was not taken is undone through the worker's queue."""
        with self._lock:
            self.cancelled = True
            finished = self._state is _State.FINISHED
            if finished:
                self._state = _State.ENDED
        if finished:
            self._undo(self.undo_records())
        else:
            self._wake()

    def undo_records(self) -> list[Undo]:
        """What puts every sequence back where the run found it."""
        return [Undo.of(item.kv_cache, out.kv_cache) for item, out in zip(self.items, self.last) if out is not None]

    # -- the worker's side ---------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._state is _State.RUNNING

    @property
    def paused(self) -> bool:
        """Its queue is full: it waits for its consumer."""
        return len(self._entries) >= self.bound

    def inputs(self) -> list[DecodeInput]:
        return [item for _, item in self.live]

    def advance(self, outs: list[DecodeOutput], seen_stop: bool = True) -> None:
        """After a forward (worker thread): applies the stop rules and queues the entry.
        ``seen_stop=False``: a stop asked for does not end the run at this entry (a
        burst's forward that ran before the worker saw the stop, see ``runs.py``)."""
        stopping = self.stop_requested and seen_stop
        going, entry = [], []
        for (index, item), out in zip(self.live, outs):
            self.emitted[index] += 1
            self.last[index] = out
            token = out.chosen.token_id
            finish = (Finish.STOP_TOKEN if token in self.stop_ids
                      else Finish.LENGTH if self.emitted[index] >= self.limit
                      else Finish.STOPPED if stopping
                      else Finish.MAX_SEQUENCE_LENGTH if out.kv_cache.sequence_length >= self.max_len
                      else None)
            if finish is None:
                going.append((index, DecodeInput(token, out.kv_cache, item.token_choice)))
            entry.append(Emitted(index, out, finish))
        self.live = going
        with self._lock:
            self._entries.append(entry)
            if not going and self._state is _State.RUNNING:
                self._state = _State.FINISHED
        self.on_entry()

    def end(self, error: BaseException, undo: Callable[[list[Undo]], object] | None) -> None:
        """Ends a running run with ``error`` (worker thread), putting its sequences back
        with ``undo`` (the executor's, called right here); ``undo=None`` for a worker that
        can no longer run anything."""
        with self._lock:
            if self._state is not _State.RUNNING:
                return
            self._state = _State.ENDED
            self._entries.clear()  # tokens now undone are not sent
            self._error = error
        if undo is not None and (records := self.undo_records()):
            undo(records)
        self.on_entry()
