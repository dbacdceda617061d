"""Disaggregated placement: prompts on prefill replicas, decoding on decode replicas.

A prompt is one large compute-bound forward; a decode step is a small
memory-bound one that many sequences share.  On one server a long prompt stalls
every decode batched beside it, so NVIDIA Dynamo and llm-d run prompts on
prefill workers and move each sequence's KV to a decode worker before its first
decode step.  A replica set does the same when its policy gives replicas a role
(``ReplicaPolicy(roles={target: "prefill" | "decode"})``; unmarked replicas do
both): new prompts are placed among the replicas that prefill, and before a
sequence's first call that is not a prompt (decode, batch or session step,
decoding ahead, verify, truncate, fork) its prefill replica pushes it to a
decode replica (PushSequence, move semantics, with a ticket that replica
issued), the same migration that drains a replica.

Disaggregation only ever moves work: every failure leaves a sequence that
decodes somewhere.  No usable prefill replica: the prompt goes to any replica
(logged).  No usable decode replica, or the push refused or failed: the
sequence stays on its prefill replica and decodes there (logged, not tried
again).  Its replica dies later: the replica set's failover replays it, on a
decode replica where one is usable.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Generator, Iterable, Mapping, Sequence

if TYPE_CHECKING:
    from .fleet import _Replica, _Sequence
    from ferrum_rpc.types import KvCacheHandle

log = logging.getLogger(__name__)

PREFILL, DECODE = "prefill", "decode"
Flow = Generator[Any, Any, Any]


class Roles:
    """Which replicas of a set prefill and which decode (all do both when no role is given)."""

    def __init__(self, replicas: Iterable[_Replica], roles: Mapping[str, str]):
        """Raises ValueError for a role other than "prefill"/"decode" or a target that is
        none of the replicas (a typo would silently disable the split)."""
        replicas = list(replicas)
        targets = {r.target for r in replicas}
        for target, role in roles.items():
            if role not in (PREFILL, DECODE):
                raise ValueError(f"replica role {role!r} for {target}: expected {PREFILL!r} or {DECODE!r}")
            if target not in targets:
                raise ValueError(f"replica role for {target}, which is none of the replicas {sorted(targets)}")
        self.enabled = bool(roles)
        self._only = {role: {r for r in replicas if roles.get(r.target) == role} for role in (PREFILL, DECODE)}

    def outside(self, role: str) -> set[_Replica]:
        """The replicas that do not take ``role``'s work (those marked for the other role)."""
        return self._only[DECODE if role == PREFILL else PREFILL]

    def place_flow(self, place, tokens: Sequence[int], exclude: set[_Replica], role: str) -> Flow:
        """``place(tokens, exclude)`` among the replicas of ``role``, else among all (logged)."""
        others = self.outside(role)
        replica = yield from place(tokens, set(exclude) | others)
        if replica is None and others - set(exclude):
            replica = yield from place(tokens, exclude)
            if replica is not None:
                log.warning("no %s replica usable: %d tokens placed on %s", role, len(tokens), replica.target)
        return replica

    def handoff_flow(self, place, migrate, seq: _Sequence, send: KvCacheHandle) -> Flow:
        """Moves ``seq`` off its prefill replica to a decode replica, once, before it decodes;
        returns the handle to send (``send`` itself when it stays).  ``place(tokens,
        exclude)`` and ``migrate(seq, send, why, target)`` are the replica set's flows."""
        old = seq.replica
        if not self.enabled or seq.stays or old not in self._only[PREFILL]:
            return send
        seq.stays = True  # one try: a failed move is not retried on every step
        tokens = seq.tokens.tolist() if seq.tokens is not None else []
        target = yield from place(tokens, {old} | self.outside(DECODE))
        moved = None if target is None else (yield from migrate(seq, send, "prefill done", target))
        if moved is None:
            log.warning("sequence %s stays on prefill replica %s and decodes there (%s)", send.cache_id, old.target,
                        "no decode replica usable" if target is None else "the push failed")
            return send
        seq.stays = False  # it may be moved again only if it lands on a prefill replica by a failover
        return moved
