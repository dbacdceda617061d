"""The prefix cache's index: which block holds the full content a chain hash names.

A block is indexed once its content is whole and its sequence's weights are the
serving ones; it stays indexed (reusable by a new prompt with the same leading
tokens) until the free list hands it out again or the weights change.  Every change
is told to the KV-event streams (``events.py``) as a Stored or Removed event."""

from __future__ import annotations

from .events import KvEventHub, Removed, Stored


class PrefixIndex:
    """Chain hash <-> block, and what a KV-event stream tells of each indexed block."""

    def __init__(self) -> None:
        self.hash_of: dict[int, bytes] = {}  # block -> hash of its full content
        self.block_of: dict[bytes, int] = {}  # hash -> block
        # hash -> (tenant, parent hash, tokens) of every indexed block: what KV events tell
        self._published: dict[bytes, tuple[str, bytes, tuple[int, ...]]] = {}
        self.events: KvEventHub | None = None  # set by the executor

    def __contains__(self, block: int) -> bool:
        return block in self.hash_of

    def lookup(self, digest: bytes) -> int | None:
        """The block holding the content ``digest`` names, or None."""
        return self.block_of.get(digest)

    def add(self, block: int, digest: bytes, tenant: str, parent: bytes, tokens: tuple[int, ...]) -> None:
        """Indexes ``block`` under ``digest`` unless either is indexed already (the first
        copy of a content stays the one a hit finds)."""
        if block in self.hash_of or digest in self.block_of:
            return
        self.hash_of[block] = digest
        self.block_of[digest] = block
        self._published[digest] = (tenant, parent, tokens)
        if self.events is not None and self.events.active:
            self.events.publish(tenant, Stored(digest, parent, tokens))

    def forget(self, block: int) -> None:
        """Drops ``block`` from the index (it is about to hold other content)."""
        digest = self.hash_of.pop(block, None)
        if digest is not None and self.block_of.get(digest) == block:
            del self.block_of[digest]
            tenant = self._published.pop(digest)[0]
            if self.events is not None and self.events.active:
                self.events.publish(tenant, Removed(digest))

    def clear(self) -> None:
        """Forgets every block (the weights changed); event streams resync."""
        self.hash_of.clear()
        self.block_of.clear()
        self._published.clear()
        if self.events is not None:
            self.events.resync_all()

    def stored(self, tenant: str) -> list[Stored]:
        """The indexed blocks of ``tenant``, in the order they were stored (a KV-event snapshot)."""
        return [Stored(d, parent, tokens) for d, (t, parent, tokens) in self._published.items() if t == tenant]
