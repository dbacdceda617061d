"""A replica set's bookkeeping, without I/O: the replicas as the client knows them
(load, room, health), the live sequences with every token in their KV (the history
a failover replays) and how a history is replayed, and the first-tokens LRU that
placement falls back on without KV events.  :mod:`ferrum_rpc.client.replicas`
drives the calls; everything here is shared by a client's threads under
``_Fleet.lock``.
"""

from __future__ import annotations

import logging
import random
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

from ferrum_rpc.types import ExecutorStatus, KvCacheHandle

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .replicas.policy import ReplicaPolicy

Span = tuple[int, int]


class _Replica:
    """One server of the set: its client and what this client knows of it."""

    def __init__(self, target: str, client: Any):
        self.target, self.client = target, client
        self.status: ExecutorStatus | None = None
        self.status_at = float("-inf")
        self.instance_id = ""
        self.block_size = 0
        self.unusable_until = 0.0
        self.healthy = True  # False from a failure until a status probe finds it serving
        self.inflight = 0  # this client's calls on it now
        self.placed_tokens = 0  # tokens this client placed on it since its last status

    def usable(self, now: float) -> bool:
        return now >= self.unusable_until

    def fresh(self, now: float, ttl: float) -> bool:
        return self.status is not None and now - self.status_at < ttl

    def placed_blocks(self) -> float:
        return self.placed_tokens / max(self.block_size, 1)

    def load(self) -> float:
        """Queued calls (the server's queue and this client's in flight) plus the used
        fraction of the KV pool, counting what was placed since the last status."""
        status = self.status
        used = (status.kv_blocks_used + self.placed_blocks()) / max(status.kv_blocks_total, 1)
        return status.queue_depth + self.inflight + min(used, 1.0)

    def fits(self, num_tokens: int) -> bool:
        return self.status.kv_blocks_free - self.placed_blocks() >= num_tokens / max(self.block_size, 1)

    def __repr__(self) -> str:
        return f"_Replica({self.target})"


@dataclass(frozen=True)
class TrackedSequence:
    """What a replica-set client knows of one live sequence: its current handle, the
    replica that owns it and the tokens in its KV (the history a failover replays)."""

    handle: KvCacheHandle
    replica: str
    tokens: tuple[int, ...] | None
    prompt_spans: tuple[tuple[int, int], ...] = ()  # [start, end) of what Prefills appended; the rest is output


def _history(tokens: Iterable[int]) -> array:
    """Token ids as a client remembers them: 4 bytes each (a list of ints takes ~36)."""
    return array("I", tokens)


@dataclass(eq=False)
class _Sequence:
    """A live sequence: its current handle, owner and every token in its KV (None:
    unknown, so it cannot be replayed)."""

    handle: KvCacheHandle
    tokens: array | None
    replica: _Replica
    keys: list[tuple[str, str]] = field(default_factory=list)  # (instance, cache id) of this and older handles
    # A call on it ended DEADLINE_EXCEEDED in this client, so the server may have run it
    # anyway (its reply came too late): a LENGTH_MISMATCH on the next call means "resync".
    unsure: bool = False
    # [start, end) of the tokens each Prefill appended, as the server records them
    # (kv_manager's prompt_spans): the rest is output.  A replay rebuilds them.
    spans: list[Span] = field(default_factory=list)
    stays: bool = False  # disaggregated placement: it decodes where it is (a move to a decode replica was tried)


def shrink_spans(spans: list[Span], length: int) -> None:
    """The server's rule (``BlockManager.shrink``) for a sequence cut to ``length``."""
    while spans and spans[-1][0] >= length:
        spans.pop()
    if spans and spans[-1][1] > length:
        spans[-1] = (spans[-1][0], length)


def replay_pieces(length: int, spans: Sequence[Span]) -> list[tuple[int, int, bool]]:
    """How a history of ``length`` tokens is replayed: (start, end, prompt) pieces, a
    Prefill each prompt span and a ForwardVerify (output) each gap between and after
    them.  Spans that do not start at 0 (unknown): one Prefill of everything."""
    if not spans or spans[0][0] != 0:
        return [(0, length, True)]
    pieces, at = [], 0
    for start, end in spans:
        end = min(end, length)
        if start >= end:
            continue
        if start > at:
            pieces.append((at, start, False))
        pieces.append((start, end, True))
        at = end
    if at < length:
        pieces.append((at, length, False))
    return pieces


def _key(handle: KvCacheHandle) -> tuple[str, str]:
    return handle.server_instance_id, handle.cache_id


class _Fleet:
    """The replicas, the live sequences by handle (old handles as aliases) and the
    prefix-locality LRU; shared by a client's threads under one lock."""

    def __init__(self, replicas: list[_Replica], policy: ReplicaPolicy):
        self.replicas, self.policy = replicas, policy
        self.random = random.Random(policy.seed)
        self.lock = threading.Lock()
        self._sequences: dict[tuple[str, str], _Sequence] = {}
        self._prefixes: OrderedDict[int, _Replica] = OrderedDict()

    def resolve(self, handle: KvCacheHandle) -> tuple[_Sequence | None, KvCacheHandle]:
        """The sequence a caller's handle names and the handle to send for it: the
        current one when the caller holds an older one (after a failover), with the
        caller's length, so the server still checks it."""
        with self.lock:
            seq = self._sequences.get(_key(handle))
        if seq is None or _key(seq.handle) == _key(handle):
            return seq, handle
        return seq, replace(seq.handle, sequence_length=handle.sequence_length)

    def by_cache_id(self, cache_id: str) -> _Sequence | None:
        with self.lock:
            return next((s for (_, cid), s in self._sequences.items() if cid == cache_id), None)

    def owner(self, handle: KvCacheHandle) -> _Replica | None:
        return next((r for r in self.replicas if r.instance_id == handle.server_instance_id), None)

    def track(self, replica: _Replica, tokens: Sequence[int] | None, handle: KvCacheHandle,
              spans: Sequence[Span] | None = None) -> _Sequence:
        """A new sequence: by default one a Prefill of ``tokens`` made (all prompt)."""
        if spans is None:
            spans = [(0, len(tokens))] if tokens else []
        seq = _Sequence(handle, _history(tokens) if tokens is not None else None, replica, [_key(handle)],
                        spans=list(spans))
        with self.lock:
            self._sequences[_key(handle)] = seq
        self.learn(replica, handle.server_instance_id)
        return seq

    def advance(self, seq: _Sequence, before: int, added: Sequence[int], handle: KvCacheHandle,
                prompt: bool = False) -> None:
        """A call on ``seq`` succeeded: its KV held ``before`` tokens, then ``added`` went in
        (by a Prefill when ``prompt``: prompt tokens; else output)."""
        with self.lock:
            seq.unsure = False
            shrink_spans(seq.spans, before)
            if prompt and added:
                seq.spans.append((before, before + len(added)))
            if seq.tokens is not None:
                seq.tokens = seq.tokens[:before]
                seq.tokens.extend(added)
                if len(seq.tokens) != handle.sequence_length:
                    log.warning("sequence %s: %d tokens remembered, %d on the server; it can no longer "
                                "be replayed", handle.cache_id, len(seq.tokens), handle.sequence_length)
                    seq.tokens = None
            self._rekey(seq, handle)

    def rebind(self, seq: _Sequence, replica: _Replica, handle: KvCacheHandle) -> None:
        """After a replay: the sequence lives on ``replica`` as ``handle``."""
        with self.lock:
            seq.replica = replica
            self._rekey(seq, handle)
        self.learn(replica, handle.server_instance_id)

    def _rekey(self, seq: _Sequence, handle: KvCacheHandle) -> None:
        seq.handle = handle
        if _key(handle) not in seq.keys:
            seq.keys.append(_key(handle))
        self._sequences[_key(handle)] = seq

    def forget(self, seq: _Sequence) -> None:
        with self.lock:
            for key in seq.keys:
                self._sequences.pop(key, None)

    def live(self) -> list[TrackedSequence]:
        with self.lock:
            unique = {id(s): s for s in self._sequences.values()}.values()
            return [TrackedSequence(s.handle, s.replica.target, tuple(s.tokens) if s.tokens is not None else None,
                                    tuple(s.spans)) for s in unique]

    def learn(self, replica: _Replica, instance_id: str) -> None:
        replica.instance_id = instance_id or replica.instance_id

    def prefix_key(self, tokens: Sequence[int]) -> int | None:
        n = self.policy.prefix_tokens
        return hash(tuple(tokens[:n])) if n and len(tokens) >= n else None

    def preferred(self, key: int | None) -> _Replica | None:
        with self.lock:
            if key is None or key not in self._prefixes:
                return None
            self._prefixes.move_to_end(key)
            return self._prefixes[key]

    def remember_prefix(self, tokens: Sequence[int], replica: _Replica) -> None:
        key = self.prefix_key(tokens)
        if key is None:
            return
        with self.lock:
            self._prefixes[key] = replica
            self._prefixes.move_to_end(key)
            while len(self._prefixes) > self.policy.prefix_entries:
                self._prefixes.popitem(last=False)
