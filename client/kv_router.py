"""Prefix-aware placement from the servers' KV events (``WatchKvEvents``).

Each replica tells, through its event stream, which prefix-cache blocks of this
caller's tenant it holds (a block is named by a hash chained over the prompt's
blocks, see the proto's ``KvBlock``).  :class:`KvRouter` keeps one
:class:`PrefixIndex` per replica, fed by a background thread per replica, and
answers how many leading blocks of a prompt each replica would serve from its
cache: the replica set places a new prompt where that is longest.  This replaces
the first-tokens LRU, which knew only this client's own placements, guessed from
a fixed window of tokens, and never learnt that a server evicted a prefix.

A stream that breaks (the replica restarts, the network drops) is reopened with
backoff and starts from a snapshot; a gap in the event numbers, or the server's
``resync``, also restarts the index from a snapshot.  Until a replica's index is
complete it is not consulted.  A server that does not serve KV events
(UNIMPLEMENTED: an older server, or prefix caching off) is left to the LRU.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Sequence

import grpc

from ferrum_rpc.hashing import block_chain as chain
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 5.0)  # between attempts to reopen a replica's stream


class Gap(Exception):
    """An event arrived out of order: the index has a hole and must restart."""


class PrefixIndex:
    """One replica's cached blocks of this tenant, as its events tell."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.root, self.block_size, self.next = b"", 0, 0
        self.adapter_roots: dict[str, bytes] = {}
        self.hashes: set[bytes] = set()
        self.ready = False  # a snapshot arrived and every event since

    def start(self, hello: pb.KvEventsHello) -> None:
        with self._lock:
            self.root, self.block_size, self.next = hello.chain_root, hello.block_size, hello.next_sequence
            self.adapter_roots = dict(hello.adapter_roots)
            self.hashes = {b.block_hash for b in hello.cached}
            self.ready = True

    def apply(self, events) -> None:
        with self._lock:
            for event in events:
                if event.sequence != self.next:
                    self.ready = False
                    raise Gap(f"event {event.sequence} after {self.next - 1}")
                self.next += 1
                kind = event.WhichOneof("kind")
                if kind == "stored":
                    self.hashes.add(event.stored.block_hash)
                elif kind == "removed":
                    self.hashes.discard(event.removed)
                elif kind == "all_cleared":
                    self.hashes.clear()

    def stop(self) -> None:
        with self._lock:
            self.ready = False
            self.hashes = set()

    def matched_tokens(self, tokens: Sequence[int], adapter: str = "") -> int | None:
        """Leading tokens of ``tokens`` this replica holds as cached blocks for sequences
        running ``adapter`` ("": the base model; 0 where it does not hold the adapter;
        None: unknown)."""
        with self._lock:
            if not self.ready or not self.block_size:
                return None
            root = self.adapter_roots.get(adapter) if adapter else self.root
            if root is None:
                return 0
            n = 0
            for digest in chain(root, self.block_size, tokens):
                if digest not in self.hashes:
                    break
                n += 1
            return n * self.block_size


class KvRouter:
    """One :class:`PrefixIndex` per target, each fed by its own watching thread.

    Args:
        targets: the replicas.
        open_channel: ``target -> grpc.Channel`` (synchronous; with the caller's TLS and token).
        model: the model whose pool to watch ("" = the server's only one).
    """

    def __init__(self, targets: Sequence[str], open_channel: Callable[[str], grpc.Channel], model: str = ""):
        self.model = model
        self.indexes = {t: PrefixIndex() for t in targets}
        self._open = open_channel
        self._closed = threading.Event()
        self._calls: dict[str, object] = {}
        self._lock = threading.Lock()
        self.unsupported: set[str] = set()
        self._threads = [threading.Thread(target=self._watch, args=(t,), name=f"kv-events {t}", daemon=True)
                         for t in targets]
        for thread in self._threads:
            thread.start()

    def matched_tokens(self, tokens: Sequence[int], adapter: str = "") -> dict[str, int]:
        """Per target whose index is complete: the leading tokens of ``tokens`` it has
        cached for sequences running ``adapter``."""
        out = {}
        for target, index in self.indexes.items():
            n = index.matched_tokens(tokens, adapter)
            if n is not None:
                out[target] = n
        return out

    def ready(self, target: str) -> bool:
        return self.indexes[target].ready

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            calls = list(self._calls.values())
        for call in calls:
            call.cancel()
        for thread in self._threads:
            thread.join(timeout=5)

    def _watch(self, target: str) -> None:
        index, attempt = self.indexes[target], 0
        channel = self._open(target)
        stub = pb_grpc.ModelExecutorStub(channel)
        try:
            while not self._closed.is_set():
                call = stub.WatchKvEvents(pb.WatchKvEventsRequest(model=self.model, snapshot=True))
                with self._lock:
                    self._calls[target] = call
                if self._closed.is_set():
                    call.cancel()
                try:
                    for batch in call:
                        if batch.HasField("hello"):
                            if batch.resync:
                                log.info("kv events from %s: fell behind, resynced", target)
                            index.start(batch.hello)
                            attempt = 0
                        index.apply(batch.events)
                    log.info("kv events from %s: the stream ended (the server drains, or the model unloads); "
                             "reopening", target)
                except Gap as gap:
                    log.warning("kv events from %s: %s; restarting from a snapshot", target, gap)
                    call.cancel()
                except grpc.RpcError as err:
                    if err.code() == grpc.StatusCode.UNIMPLEMENTED:
                        log.info("kv events: %s does not serve them (%s); placing by the first-tokens LRU there",
                                 target, err.details())
                        self.unsupported.add(target)
                        return
                    if err.code() != grpc.StatusCode.CANCELLED or not self._closed.is_set():
                        log.debug("kv events from %s: %s", target, err.code().name)
                finally:
                    index.stop()
                    with self._lock:
                        self._calls.pop(target, None)
                self._closed.wait(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])
                attempt += 1
        finally:
            index.stop()
            channel.close()
