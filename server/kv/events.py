"""KV events for routers: the prefix cache's blocks as they are stored and removed.

``BlockManager`` (blocks.py) tells a :class:`KvEventHub` each time a full
block becomes reusable under its chained hash (``stored``) and each time such a
block stops being reusable (``removed``: its KV is about to be overwritten);
the hub numbers them per tenant and hands them to that tenant's subscribers
(``WatchKvEvents`` streams), never to another tenant's.

Threads: the books change on the model worker's thread only, so that thread
publishes; subscribers live on the server's event loop.  Publishing appends to
each subscriber's buffer under a lock and wakes its coroutine once
(``call_soon_threadsafe``), so one forward's events go out as one message.
With nobody subscribed, publishing is one attribute check.  A subscriber is
registered, and a snapshot taken, on the worker thread between forwards
(``ModelWorker.call``), so its snapshot and the events that follow it agree.

A subscriber that falls ``QUEUE_LIMIT`` events behind stops collecting; its
stream then says ``resync`` and carries a fresh snapshot (taken the same way),
so a router never silently keeps an index with holes in it.  vLLM's publisher
drops events for a slow subscriber and leaves the gap to be found from the
numbers; a fresh snapshot in the same stream is one step less for a router.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

QUEUE_LIMIT = 8192  # events a subscriber may fall behind before it is resynced


@dataclass(frozen=True)
class Stored:
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class Removed:
    digest: bytes


@dataclass(frozen=True)
class Cleared:
    pass


@dataclass(eq=False)  # one per stream: compared (and hashed) by identity
class Subscriber:
    tenant: str
    loop: asyncio.AbstractEventLoop
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    buffer: list = field(default_factory=list)  # (sequence, event)
    behind: bool = False  # fell QUEUE_LIMIT behind: collects nothing until resynced
    closed: bool = False  # the pool is gone: the stream ends after what it holds
    _waking: bool = False

    def _wake(self) -> None:  # on the event loop
        self._waking = False
        self.wake.set()


class KvEventHub:
    """One pool's event numbering and subscribers (see the module docstring)."""

    def __init__(self, block_size: int, queue_limit: int = QUEUE_LIMIT):
        self.block_size, self.queue_limit = block_size, queue_limit
        self._lock = threading.Lock()
        self._subs: dict[str, list[Subscriber]] = {}
        self._next: dict[str, int] = {}  # tenant -> number of its next event
        self.active = False  # anyone subscribed: the only check publishing makes otherwise

    # -- the worker thread ----------------------------------------------------------------
    def publish(self, tenant: str, event) -> None:
        with self._lock:
            subs = self._subs.get(tenant)
            if not subs:
                return
            number = self._next[tenant] = self._next.get(tenant, 0) + 1
            for sub in subs:
                if sub.behind:
                    continue
                if len(sub.buffer) >= self.queue_limit:
                    sub.behind, sub.buffer = True, []
                else:
                    sub.buffer.append((number, event))
                self._notify(sub)

    def publish_all(self, event) -> None:
        """``event`` to every tenant watching (the pool is cleared)."""
        with self._lock:
            tenants = list(self._subs)
        for tenant in tenants:
            self.publish(tenant, event)

    def subscribe(self, sub: Subscriber, snapshot) -> tuple[int, list[Stored]]:
        """Registers ``sub`` (or resyncs it); call on the worker thread.  ``snapshot()``
        gives the tenant's cached blocks now.  Returns (next number, blocks)."""
        with self._lock:
            blocks = snapshot()
            subs = self._subs.setdefault(sub.tenant, [])
            if sub not in subs:
                subs.append(sub)
            sub.behind, sub.buffer = False, []
            self.active = True
            return self._next.get(sub.tenant, 0) + 1, blocks

    def unsubscribe(self, sub: Subscriber) -> None:
        with self._lock:
            subs = self._subs.get(sub.tenant, [])
            if sub in subs:
                subs.remove(sub)
            if not subs:
                self._subs.pop(sub.tenant, None)
            self.active = bool(self._subs)

    def resync_all(self) -> None:
        """Every stream starts over from a fresh hello and snapshot (the weights changed:
        chains start from new roots, and every cached block was forgotten; or the
        adapters changed, whose roots the hello names)."""
        with self._lock:
            for subs in self._subs.values():
                for sub in subs:
                    sub.behind, sub.buffer = True, []
                    self._notify(sub)

    def close(self) -> None:
        """The pool is gone (the model unloads): every stream says all_cleared and ends."""
        self.publish_all(Cleared())
        with self._lock:
            for subs in self._subs.values():
                for sub in subs:
                    sub.closed = True
                    self._notify(sub)

    @staticmethod
    def _notify(sub: Subscriber) -> None:
        if not sub._waking:
            sub._waking = True
            try:
                sub.loop.call_soon_threadsafe(sub._wake)
            except RuntimeError:  # its loop is closed: the stream is gone
                pass

    # -- the event loop -------------------------------------------------------------------
    def take(self, sub: Subscriber) -> tuple[list, bool, bool]:
        """(events so far, whether ``sub`` must be resynced first, whether its stream ends
        after them)."""
        with self._lock:
            sub.wake.clear()
            events, sub.buffer = sub.buffer, []
            return events, sub.behind, sub.closed
