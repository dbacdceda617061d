"""How a replica set places sequences and bounds failover (:class:`ReplicaPolicy`), and
which errors mean a sequence has to leave its replica (:func:`moves_sequence`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import grpc

from ferrum_rpc.errors import ExecutorError, Reason
from ferrum_rpc.types import LogitsPolicy

REPLAY_LOGITS = LogitsPolicy.argmax()  # a replay only needs the KV; its logits are dropped


@dataclass(frozen=True)
class ReplicaPolicy:
    """How a replica-set client places sequences and bounds failover.

    Attributes:
        max_attempts: tries to move one sequence (or to place a new one) before
            :class:`~ferrum_rpc.errors.FailoverFailed`: each replica tried counts, and
            so does each wait of ``down_cooldown_s`` for one when none is usable.
        failover_timeout_s: longest one failover may take, waiting for a replica to
            come back included.
        status_ttl_s: how long a replica's GetStatus answer is used for placement
            before it is asked again (polling load: replicas x clients / ttl calls
            a second at most, and only while new sequences are being placed).
        probe_timeout_s: deadline of those GetStatus calls.
        down_cooldown_s: an unreachable, draining or loading replica is left out
            this long, then probed again.
        kv_events: watch each replica's KV events (``WatchKvEvents``,
            :mod:`ferrum_rpc.client.kv_router`) and prefer, for a new prompt, the
            replica whose prefix cache holds the longest run of its leading blocks,
            whoever put them there; replicas without events fall back to the
            first-tokens LRU below.
        prefix_tokens: the fallback LRU: prompts of at least this many tokens are
            keyed by the hash of their first ``prefix_tokens`` tokens; the replica
            that took the last prompt with that key is preferred (0: no LRU).
        prefix_entries: keys remembered (least recently used go first).
        locality_slack: the prefix's replica is taken unless its load exceeds the
            better of the two random ones by more than this (load: queued calls plus
            this client's calls in flight, plus the used fraction of the KV pool).
        seed: seeds the random choice of the two (None: unseeded).
        migrate: a sequence whose owner is draining (alive, refusing new work) moves by
            migration: the owner pushes its KV to the new replica (PushSequence, with a
            ticket the new replica issued), nothing recomputed; replay is the fallback
            (the owner is dead, or the push failed).  Owners need ``--export-grace`` to
            answer pushes once their in-flight calls are done.
        roles: disaggregated placement (:mod:`ferrum_rpc.client.disagg`): target ->
            "prefill" or "decode" (unmarked replicas do both).  New prompts go to the
            replicas that prefill; each sequence moves to one that decodes (a push)
            before its first decode step.  Empty: every replica does everything.
    """

    max_attempts: int = 3
    failover_timeout_s: float = 15.0
    status_ttl_s: float = 1.0
    probe_timeout_s: float = 2.0
    down_cooldown_s: float = 1.0
    prefix_tokens: int = 32
    prefix_entries: int = 4096
    locality_slack: float = 2.0
    seed: int | None = None
    migrate: bool = True
    kv_events: bool = True
    roles: Mapping[str, str] = field(default_factory=dict)


def moves_sequence(err: ExecutorError) -> bool:
    """Whether an error means "this replica cannot hold the sequence any more": it is
    unreachable or shutting down (UNAVAILABLE: DRAINING, MODEL_LOADING, no
    connection), it stopped while the call waited (CANCELLED by the server's stop),
    or it restarted and its handles are stale."""
    return err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) \
        or err.reason is Reason.STALE_HANDLE
