"""Replica sets: one client over several servers that know nothing of each other.

The design keeps servers unaware of each other; the caller's client does the rest.
A handle names its server instance, so every call on a sequence goes to the replica
that owns it (affinity).  New sequences go where there is room: the better of two
random replicas by their cached GetStatus (queue depth, KV blocks), unless a
recently placed prompt with the same first tokens points at a replica that already
holds that prefix in its cache (locality).  And since the client remembers every
token it has sent on a live sequence (prompt, decoded tokens, truncations; forks
copy the history), it can rebuild a sequence on another replica by replaying that
history when the owner dies (UNAVAILABLE), restarts (STALE_HANDLE) or drains
(DRAINING): the tokens Prefills appended as Prefills, the rest (decoded, verified)
as ForwardVerify calls, so the rebuilt sequence splits prompt from output as the
server did (the split a ``TokenChoice``'s presence and frequency penalties use).
The caller's call returns what it would have returned, carrying the new handle,
and the old handle keeps working as an alias.  With replica roles
(``ReplicaPolicy.roles``, :mod:`ferrum_rpc.client.disagg`), prompts run on prefill
replicas and each sequence moves to a decode replica before it decodes.

The bookkeeping (replicas, sequences and their histories, replay pieces, the LRU)
is :mod:`ferrum_rpc.client.fleet`; KV-event placement :mod:`ferrum_rpc.client.kv_router`.
The routing logic is written once, as generators ("flows") that yield the calls
they need (:class:`_Call`, :class:`_Parallel`, :class:`_Sleep`) and get back results
or have the call's exception thrown in; every public call is one such flow
(:class:`_Contract`).  A replica-set client holds one single-target client per
replica; the blocking one drives the flows on the caller's thread (parallel calls on
a small pool), the asyncio one awaits them.  :func:`connect` (and
:func:`connect_async`) build a single-target client for one server and a replica set
for several.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Generator, Iterable, Mapping, Sequence

import grpc

from .ahead import AheadResult, run_ahead, run_ahead_async
from .kv_router import KvRouter
from .client import (
    AsyncExecutorClient,
    DEFAULT_KEEPALIVE,
    DEFAULT_MAX_MESSAGE_BYTES,
    ClientTls,
    ExecutorClient,
    Keepalive,
    _channel,
    _options,
    resolve_targets,
)
from .disagg import DECODE, PREFILL, Roles
from .fleet import (  # noqa: F401  (shrink_spans, replay_pieces: named from here too)
    TrackedSequence,
    _Fleet,
    _key,
    _Replica,
    _Sequence,
    replay_pieces,
    shrink_spans,
)
from ferrum_rpc import sequence_file
from .rpc import RPCS, DecodeItem, Prompt, method, split_prompt, with_methods
from ferrum_rpc.errors import ExecutorError, FailoverFailed, KvCapacityExhausted, Reason, StaleHandle
from ferrum_rpc.types import (
    DecodeInput,
    HiddenStatesRequest,
    KvCacheHandle,
    LogitsPolicy,
    ServerState,
    SpeculativeSampling,
    TokenChoice,
)

__all__ = ["AsyncReplicaSetClient", "ReplicaPolicy", "ReplicaSetClient", "TrackedSequence", "connect",
           "connect_async", "resolve_targets"]

log = logging.getLogger(__name__)

REPLAY_LOGITS = LogitsPolicy.argmax()  # a replay only needs the KV; its logits are dropped
# A replica that went away should be retried soon when it comes back (gRPC's default
# reconnect backoff grows to two minutes).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


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


# -- what flows yield ---------------------------------------------------------------------


@dataclass
class _Call:
    """One client call on a replica: ``fn(*args)`` (a value, or an awaitable in asyncio)."""

    replica: _Replica
    fn: Callable
    args: tuple = ()
    counted: bool = True  # counts toward the replica's in-flight load


@dataclass
class _Parallel:
    """Calls run together; the flow gets back a list of values or ExecutorErrors."""

    calls: list[_Call]


@dataclass
class _Sleep:
    seconds: float


Flow = Generator[Any, Any, Any]


@dataclass(eq=False)
class _Item:
    """One entry of a split batch: what it adds, the sequence it continues (None: a
    new prompt, or a handle this client does not track) and where it goes."""

    index: int
    tokens: list[int]
    seq: _Sequence | None
    send: KvCacheHandle | None
    replica: _Replica | None
    before: int = 0
    created: bool = False  # a new sequence made by this call (undone by releasing it)
    prompt: bool = False  # what it adds is prompt (a BatchPrefill), not output


class _Routing:
    """Placement, affinity and failover as flows, shared by the blocking and asyncio
    replica sets, and what they share besides: construction, the replicas' clients."""

    _client_class: type  # the single-target client of each replica
    _session_class: type  # what decode_session opens

    def __init__(self, target: str | Sequence[str], *, model: str = "", timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ClientTls | None = None,
                 token: str | None = None, failover: bool = True, replica_policy: ReplicaPolicy | None = None,
                 channel_options: Sequence[tuple[str, object]] = (),
                 keepalive: Keepalive | None = DEFAULT_KEEPALIVE):
        """One single-target client per replica (channels that reconnect within a second);
        the other arguments are :class:`~ferrum_rpc.client.client.ExecutorClient`'s."""
        self.model, self.timeout, self.failover = model, timeout, failover
        self.policy = replica_policy or ReplicaPolicy()
        options = list(channel_options) + RECONNECT_OPTIONS
        self._fleet = _Fleet([_Replica(t, self._client_class(
            t, model=model, timeout=timeout, max_message_bytes=max_message_bytes, tls=tls, token=token,
            channel_options=options, keepalive=keepalive)) for t in resolve_targets(target)], self.policy)
        self._roles = Roles(self._fleet.replicas, self.policy.roles)
        self._router = KvRouter(
            [r.target for r in self._fleet.replicas],
            lambda t: _channel(t, _options(max_message_bytes, keepalive) + options, tls, token, aio=False),
            model) if self.policy.kv_events else None
        self._opened()

    def _preferred(self, tokens: Sequence[int]) -> _Replica | None:
        """The replica whose cache holds the longest run of ``tokens``' leading blocks (by
        its KV events; the less loaded of equals), else the first-tokens LRU's."""
        fleet = self._fleet
        if self._router is not None:
            matched = self._router.matched_tokens(tokens)
            longest = max(matched.values(), default=0)
            if longest:
                holders = [r for r in fleet.replicas if matched.get(r.target) == longest]
                return min(holders, key=lambda r: r.load() if r.status is not None else 0.0)
        return fleet.preferred(fleet.prefix_key(tokens))

    def _close_router(self) -> None:
        if self._router is not None:
            self._router.close()

    def _opened(self) -> None:
        """Called once the replicas' clients exist."""

    @property
    def replicas(self) -> list[str]:
        """The replica targets, in order."""
        return [r.target for r in self._fleet.replicas]

    def live_sequences(self) -> list[TrackedSequence]:
        """The sequences this client tracks (prefilled or forked, not released)."""
        return self._fleet.live()

    def decode_session(self):
        """A DecodeSession over the set: one stream per owning replica (see :class:`ReplicaDecodeSession`)."""
        return self._session_class(self)

    # -- replica state --------------------------------------------------------------
    def _mark(self, replica: _Replica, err: ExecutorError, unanswered: bool = False) -> None:
        """Leaves a replica out of placement for a while (or, for a restart, asks it again);
        ``unanswered``: a status probe's deadline passed (a hung or unreachable host)."""
        if err.reason is Reason.STALE_HANDLE:
            replica.status_at = float("-inf")  # a new instance: ask for its status before using it
            return
        if isinstance(err, KvCapacityExhausted) or not (moves_sequence(err) or unanswered):
            return
        if replica.healthy:  # once per outage; the probes after each cooldown log at debug level
            log.warning("replica %s left out (asked again every %.1fs): %s", replica.target,
                        self.policy.down_cooldown_s, err)
        else:
            log.debug("replica %s still left out: %s", replica.target, err)
        replica.healthy, replica.status_at = False, float("-inf")  # probed before it is used again
        replica.unusable_until = time.monotonic() + self.policy.down_cooldown_s

    def _probe_flow(self, replicas: list[_Replica]) -> Flow:
        """Refreshes the status of ``replicas`` (in parallel); leaves out those not serving."""
        results = yield _Parallel([_Call(r, r.client._status_probe, (self.policy.probe_timeout_s,), False)
                                   for r in replicas])
        for replica, result in zip(replicas, results):
            if isinstance(result, ExecutorError):
                self._mark(replica, result, unanswered=result.code is grpc.StatusCode.DEADLINE_EXCEEDED)
                continue
            if result.server_instance_id != replica.instance_id or not replica.block_size:
                try:
                    caps = yield _Call(replica, replica.client.capabilities, (), False)
                except ExecutorError as err:
                    self._mark(replica, err)
                    continue
                replica.block_size = caps.kv_block_size
                if replica.instance_id and result.server_instance_id != replica.instance_id:
                    log.info("replica %s is a new instance (%s, was %s)", replica.target,
                             result.server_instance_id, replica.instance_id)
            replica.status, replica.status_at, replica.placed_tokens = result, time.monotonic(), 0
            replica.instance_id = result.server_instance_id
            if result.state is not ServerState.SERVING:
                if replica.healthy:
                    log.info("replica %s is %s; placing elsewhere", replica.target, result.state.name.lower())
                replica.healthy = False
                replica.unusable_until = time.monotonic() + self.policy.down_cooldown_s
            elif not replica.healthy:
                log.info("replica %s is serving again", replica.target)
                replica.healthy = True

    def _place_flow(self, tokens: Sequence[int], exclude: set[_Replica] = frozenset(),
                    role: str | None = None) -> Flow:
        """The replica a new sequence of ``tokens`` goes to, or None when none is usable:
        the better of two random usable replicas by load, or the prefix's replica
        (locality) unless it is more loaded than that by ``locality_slack``; with
        replica roles, one that does ``role``'s work if any is usable."""
        if role is not None and self._roles.enabled:
            return (yield from self._roles.place_flow(self._place_flow, tokens, exclude, role))
        fleet, policy = self._fleet, self.policy
        preferred = self._preferred(tokens)
        tried: set[_Replica] = set(exclude)
        while True:
            now = time.monotonic()
            candidates = [r for r in fleet.replicas if r not in tried and r.usable(now)]
            if not candidates:
                return None
            picks = fleet.random.sample(candidates, min(2, len(candidates)))
            local = preferred if preferred in candidates and preferred not in picks else None
            asked = picks + ([local] if local else [])
            stale = [r for r in asked if not r.fresh(now, policy.status_ttl_s)]
            if stale:
                yield from self._probe_flow(stale)
            now = time.monotonic()
            ready = [r for r in asked if r.usable(now) and r.status is not None]
            tried.update(r for r in asked if r not in ready)
            choices = [r for r in picks if r in ready]
            roomy = [r for r in choices if r.fits(len(tokens))] or choices
            best = min(roomy, key=_Replica.load) if roomy else None
            if preferred in ready and preferred.fits(len(tokens)) and (
                    best is None or preferred.load() <= best.load() + policy.locality_slack):
                best = preferred
            if best is None:
                continue
            best.placed_tokens += len(tokens)
            return best

    # -- new sequences ----------------------------------------------------------------------
    def _new_sequence_flow(self, tokens: list[int], call: Callable[[Any], Any]) -> Flow:
        """Runs ``call(client)`` (a prefill of ``tokens``) on a placed replica; with failover,
        a replica that cannot take it (unreachable, draining, full) is left out and
        the next one tried, within the policy's bounds."""
        exclude: set[_Replica] = set()
        start, attempts, last = time.monotonic(), 0, None
        while True:
            replica = yield from self._place_flow(tokens, exclude, PREFILL)
            if replica is None and not self.failover:  # no retries: let the server answer
                replica = min(self._fleet.replicas, key=lambda r: r.unusable_until)
            if replica is None:
                attempts += 1
                yield from self._wait_or_fail(start, attempts, last, "place a new sequence")
                exclude.clear()
                continue
            attempts += 1
            try:
                out = yield _Call(replica, call, (replica.client,))
            except ExecutorError as err:
                if not self.failover or not (moves_sequence(err) or isinstance(err, KvCapacityExhausted)):
                    raise
                self._mark(replica, err)
                exclude.add(replica)
                last = err
                self._check_bounds(start, attempts, last, "place a new sequence")
                continue
            self._fleet.track(replica, tokens, out.kv_cache)
            self._fleet.remember_prefix(tokens, replica)
            return out

    def _check_bounds(self, start: float, attempts: int, last: ExecutorError | None, what: str) -> None:
        elapsed = time.monotonic() - start
        if attempts >= self.policy.max_attempts or elapsed >= self.policy.failover_timeout_s:
            raise FailoverFailed(f"could not {what}: {attempts} replica(s) tried in {elapsed:.1f}s"
                                 + (f"; last error {last}" if last else ""), cause=last, attempts=attempts)

    def _wait_or_fail(self, start: float, attempts: int, last: ExecutorError | None, what: str) -> Flow:
        """No replica is usable now (a round that counts as an attempt): waits for the first
        to come off its cooldown, within the policy's bounds, or raises FailoverFailed."""
        elapsed = time.monotonic() - start
        wake = min(r.unusable_until for r in self._fleet.replicas) - time.monotonic()
        if attempts >= self.policy.max_attempts or elapsed + max(wake, 0.0) >= self.policy.failover_timeout_s:
            raise FailoverFailed(f"could not {what}: no replica usable after {elapsed:.1f}s and {attempts} "
                                 f"tries (bounds: {self.policy.max_attempts} tries, "
                                 f"{self.policy.failover_timeout_s:.1f}s)"
                                 + (f"; last error {last}" if last else ""), cause=last, attempts=attempts)
        yield _Sleep(max(wake, 0.01))

    # -- calls on one sequence -------------------------------------------------------------
    def _owner_flow(self, handle: KvCacheHandle) -> Flow:
        """The replica a handle this client does not track belongs to (by instance id)."""
        owner = self._fleet.owner(handle)
        if owner is None:
            unknown = [r for r in self._fleet.replicas if not r.instance_id]
            if unknown:
                yield from self._probe_flow(unknown)
                owner = self._fleet.owner(handle)
        if owner is None:
            raise StaleHandle(f"handle {handle.cache_id!r} is from server instance "
                              f"{handle.server_instance_id!r}, which is none of this client's replicas")
        return owner

    def _sequence_flow(self, handle: KvCacheHandle, op: Callable[[Any, KvCacheHandle], Any],
                       added: Callable[[Any], Sequence[int]], result_handle=lambda out: out.kv_cache,
                       keep: int | None = None, prompt: bool = False) -> Flow:
        """``op(client, handle)`` on the sequence's owner.  On success the sequence's history
        grows by ``added(output)`` (after the first ``keep`` tokens, for a truncation;
        by default all that the handle sent holds).  When the owner cannot hold the sequence any more, its history is
        replayed elsewhere and ``op`` runs there."""
        seq, send = self._fleet.resolve(handle)
        if seq is not None and not prompt:
            send = yield from self._roles.handoff_flow(self, seq, send)
        replica = seq.replica if seq is not None else (yield from self._owner_flow(handle))
        for round_ in range(self.policy.max_attempts + 1):
            try:
                out = yield _Call(replica, op, (replica.client, send))
            except ExecutorError as err:
                if seq is not None and err.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    seq.unsure = True  # it may have run after all: the next call checks
                if seq is None or not self.failover or round_ == self.policy.max_attempts:
                    raise
                if self._resyncs(seq, err):
                    send = yield from self._resync_flow(seq, send, err)
                elif moves_sequence(err):
                    self._mark(replica, err)
                    send = yield from self._replay_flow(seq, send, err)
                else:
                    raise
                replica = seq.replica
                continue
            if seq is not None:
                new = result_handle(out)
                self._fleet.advance(seq, send.sequence_length if keep is None else keep, added(out), new, prompt)
            return out

    def _rebuild_flow(self, replica: _Replica, seq: _Sequence) -> Flow:
        """``seq``'s history on ``replica``: its prompt spans as Prefills, the tokens after
        them as ForwardVerify (output), so the server splits prompt from output as
        before; returns the last call's output.  A half-built copy is released unless
        the replica is gone."""
        tokens = seq.tokens.tolist()
        handle, out = None, None
        try:
            for start, end, prompt in replay_pieces(len(tokens), seq.spans):
                call = replica.client.prefill if prompt else replica.client.forward_verify
                out = yield _Call(replica, call, (tokens[start:end], handle, REPLAY_LOGITS))
                handle = out.kv_cache
        except ExecutorError as err:
            if handle is not None and not moves_sequence(err):
                try:
                    yield _Call(replica, replica.client.release_cache, (handle,), False)
                except ExecutorError as release_err:  # left to the server's idle timeout
                    log.info("could not release a half-replayed %s on %s: %s", handle.cache_id,
                             replica.target, release_err)
            raise
        return out

    def _replay_flow(self, seq: _Sequence, send: KvCacheHandle, cause: ExecutorError) -> Flow:
        """Rebuilds ``seq`` on a healthy replica by replaying its history (``_rebuild_flow``);
        returns the handle to send there (with the caller's length).  Raises FailoverFailed."""
        if cause.reason is Reason.DRAINING and self.policy.migrate:
            moved = yield from self._migrate_flow(seq, send, f"drain: {cause}")
            if moved is not None:
                return moved
        if not seq.tokens:
            raise FailoverFailed(f"sequence {seq.handle.cache_id!r} cannot be moved: its history is not known "
                                 f"({cause})", cause=cause)
        old = seq.replica
        # A restarted replica may take it back; so may one that is fine but whose copy is out of step (a resync).
        exclude = set() if cause.reason in (Reason.STALE_HANDLE, Reason.LENGTH_MISMATCH) else {old}
        start, attempts, last = time.monotonic(), 0, cause
        what = f"move sequence {seq.handle.cache_id!r} ({len(seq.tokens)} tokens) off {old.target}"
        while True:
            replica = yield from self._place_flow(seq.tokens, exclude, DECODE)
            if replica is None:
                attempts += 1
                yield from self._wait_or_fail(start, attempts, last, what)
                exclude.clear()
                continue
            attempts += 1
            try:
                out = yield from self._rebuild_flow(replica, seq)
            except ExecutorError as err:
                if not (moves_sequence(err) or isinstance(err, KvCapacityExhausted)):
                    raise FailoverFailed(f"could not {what}: {err}", cause=err, attempts=attempts) from err
                self._mark(replica, err)
                exclude.add(replica)
                last = err
                self._check_bounds(start, attempts, last, what)
                continue
            self._fleet.rebind(seq, replica, out.kv_cache)
            self._fleet.remember_prefix(seq.tokens, replica)
            log.warning("failover: sequence %s (%d tokens) moved from %s to %s as %s in %.1f ms (%s)",
                        send.cache_id, len(seq.tokens), old.target, replica.target, out.kv_cache.cache_id,
                        1e3 * (time.monotonic() - start), cause)
            return replace(out.kv_cache, sequence_length=send.sequence_length)

    def _migrate_flow(self, seq: _Sequence, send: KvCacheHandle, why: str, replica: _Replica | None = None) -> Flow:
        """Moves ``seq`` off its owner by a push (its KV, bit for bit) to ``replica``, by
        default one placed as for a replay; returns the handle to send there (with the
        caller's length), or None when it could not (the sequence stays where it is)."""
        old, start = seq.replica, time.monotonic()
        if replica is None:
            replica = yield from self._place_flow(seq.tokens if seq.tokens is not None else [], {old}, DECODE)
        if replica is None:
            return None
        try:
            ticket = yield _Call(replica, replica.client.create_import_ticket, (), False)
            out = yield _Call(old, old.client.push_sequence, (seq.handle, replica.target, ticket.ticket, True), False)
        except ExecutorError as err:
            log.info("could not migrate %s off %s (%s)", seq.handle.cache_id, old.target, err)
            return None
        if not out.released:  # it changed on the owner meanwhile: the copy is not it
            try:
                yield _Call(replica, replica.client.release_cache, (out.kv_cache,), False)
            except ExecutorError as err:  # left to the server's idle timeout
                log.info("could not release a stale migrated copy on %s: %s", replica.target, err)
            return None
        self._fleet.rebind(seq, replica, out.kv_cache)
        if seq.tokens is not None:
            self._fleet.remember_prefix(seq.tokens, replica)  # its full blocks are in the new replica's cache
        log.warning("sequence %s (%d tokens) migrated from %s to %s as %s in %.1f ms, %d bytes (%s)",
                    send.cache_id, out.kv_cache.sequence_length, old.target, replica.target, out.kv_cache.cache_id,
                    1e3 * (time.monotonic() - start), out.bytes_sent, why)
        return replace(out.kv_cache, sequence_length=send.sequence_length)

    @staticmethod
    def _resyncs(seq: _Sequence | None, err: ExecutorError) -> bool:
        """Whether ``err`` on a call on ``seq`` means its copy on the server is out of step
        with this client because a call that timed out here ran there after all."""
        return seq is not None and seq.unsure and bool(seq.tokens) and err.reason is Reason.LENGTH_MISMATCH

    def _resync_flow(self, seq: _Sequence, send: KvCacheHandle, cause: ExecutorError) -> Flow:
        """Rebuilds ``seq`` from the history this client knows (a replay, on any replica,
        its own included) and releases the copy of unknown length it had; returns the
        handle to send (with the caller's length)."""
        old_replica, old_handle = seq.replica, seq.handle
        seq.unsure = False
        log.warning("sequence %s: a call that timed out here ran on %s after all (%s); rebuilding it from "
                    "its %d remembered tokens", old_handle.cache_id, old_replica.target, cause, len(seq.tokens))
        send = yield from self._replay_flow(seq, send, cause)
        if _key(seq.handle) != _key(old_handle):
            try:
                yield _Call(old_replica, old_replica.client.release_cache, (old_handle,), False)
            except ExecutorError as err:  # left to the server's idle timeout
                log.info("could not release the old copy of %s on %s: %s", old_handle.cache_id,
                         old_replica.target, err)
        return send

    # -- split batches ---------------------------------------------------------------------
    def _items_flow(self, entries: Iterable[tuple[Sequence[int], KvCacheHandle | None]],
                    prompt: bool = False) -> Flow:
        """Batch entries -> items with their replica: a handle goes to its owner, a new
        prompt where placement puts it."""
        items = []
        for index, (tokens, handle) in enumerate(entries):
            tokens = list(tokens)
            if handle is None:
                replica = yield from self._place_flow(tokens, role=PREFILL)
                if replica is None:
                    replica = min(self._fleet.replicas, key=lambda r: r.unusable_until)
                items.append(_Item(index, tokens, None, None, replica, prompt=prompt))
                continue
            seq, send = self._fleet.resolve(handle)
            if seq is not None and not prompt:
                send = yield from self._roles.handoff_flow(self, seq, send)
            replica = seq.replica if seq is not None else (yield from self._owner_flow(handle))
            items.append(_Item(index, tokens, seq, send, replica, before=send.sequence_length, prompt=prompt))
        return items

    def _batch_flow(self, entries, call_for, on_group_lost=lambda replica: None, prompt: bool = False) -> Flow:
        """A batch's entries placed or routed, then run split by replica (``_grouped_flow``);
        ``prompt``: the entries add prompt tokens (a BatchPrefill)."""
        items = yield from self._items_flow(entries, prompt)
        return (yield from self._grouped_flow(items, call_for, on_group_lost))

    def _statuses_flow(self) -> Flow:
        """Every replica's status now, or the error asking it gave."""
        return (yield _Parallel([_Call(r, r.client._status_probe, (self.policy.probe_timeout_s,), False)
                                 for r in self._fleet.replicas]))

    def _grouped_flow(self, items: list[_Item], call_for: Callable[[_Replica, list[_Item]], _Call],
                      on_group_lost: Callable[[_Replica], None] = lambda replica: None) -> Flow:
        """Runs a batch split by replica, the groups in parallel, and returns the outputs
        in the items' order.  A group whose replica cannot hold its sequences is moved
        (replayed, or new prompts placed again) and run again; if any group fails for
        good, the groups that succeeded are undone (truncated back, new sequences
        released), so the call as a whole changes nothing."""
        outputs: list[Any] = [None] * len(items)
        done: list[_Item] = []
        pending = items
        try:
            for round_ in range(self.policy.max_attempts + 1):
                groups: dict[_Replica, list[_Item]] = {}
                for item in pending:
                    groups.setdefault(item.replica, []).append(item)
                results = yield _Parallel([call_for(replica, group) for replica, group in groups.items()])
                retry, failure = [], None
                for (replica, group), result in zip(groups.items(), results):
                    if not isinstance(result, ExecutorError):
                        for item, out in zip(group, result):
                            outputs[item.index] = out
                            self._commit(item, out)
                            done.append(item)
                    elif failure is None and self._movable(group, result) and round_ < self.policy.max_attempts:
                        self._mark(replica, result)
                        on_group_lost(replica)
                        retry.extend((item, result) for item in group)
                    elif failure is None and self.failover and round_ < self.policy.max_attempts and any(
                            self._resyncs(item.seq, result) for item in group):
                        retry.extend((item, result) for item in group)  # the unsure ones are rebuilt
                    else:
                        if result.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                            for item in group:
                                if item.seq is not None:
                                    item.seq.unsure = True  # it may have run after all: the next call checks
                        failure = failure or result
                if failure is not None:
                    raise failure
                if not retry:
                    return outputs
                for item, cause in retry:
                    yield from self._relocate_flow(item, cause)
                pending = [item for item, _ in retry]
        except ExecutorError:
            yield from self._undo_flow(done)
            raise
        raise AssertionError("unreachable")

    def _movable(self, group: list[_Item], err: ExecutorError) -> bool:
        return self.failover and moves_sequence(err) and all(
            item.seq is not None and item.seq.tokens or item.send is None for item in group)

    def _relocate_flow(self, item: _Item, cause: ExecutorError) -> Flow:
        if cause.reason is Reason.LENGTH_MISMATCH:  # a resync: only the sequences a timeout left unsure
            if self._resyncs(item.seq, cause):
                item.send = yield from self._resync_flow(item.seq, item.send, cause)
                item.replica = item.seq.replica
            return
        if item.seq is None:  # a new prompt: place it again, elsewhere
            replica = yield from self._place_flow(item.tokens, {item.replica}, PREFILL)
            if replica is None:
                raise FailoverFailed(f"could not place a new sequence: no replica usable ({cause})", cause=cause)
            item.replica = replica
            return
        item.send = yield from self._replay_flow(item.seq, item.send, cause)
        item.replica = item.seq.replica

    def _commit(self, item: _Item, out: Any) -> None:
        if item.send is None:
            item.seq, item.created = self._fleet.track(item.replica, item.tokens, out.kv_cache), True
            self._fleet.remember_prefix(item.tokens, item.replica)
        elif item.seq is not None:
            self._fleet.advance(item.seq, item.before, item.tokens, out.kv_cache, item.prompt)

    def _undo_flow(self, done: list[_Item]) -> Flow:
        """Takes back what the succeeded part of a failed batch did (best effort, logged)."""
        for item in done:
            seq = item.seq
            try:
                if item.created:
                    yield _Call(seq.replica, seq.replica.client.release_cache, (seq.handle,))
                    self._fleet.forget(seq)
                elif seq is not None:
                    handle = yield _Call(seq.replica, seq.replica.client.truncate_kv, (seq.handle, item.before))
                    self._fleet.advance(seq, item.before, (), handle)
            except ExecutorError as err:
                log.warning("could not undo the part of a failed batch on %s: %s", seq.replica.target, err)

    # -- anything -----------------------------------------------------------------------------
    def _any_flow(self, call: Callable[[Any], Any]) -> Flow:
        """``call(client)`` on the first usable replica that answers (queries)."""
        now, last = time.monotonic(), None
        order = sorted(self._fleet.replicas, key=lambda r: not r.usable(now))
        for replica in order:
            try:
                return (yield _Call(replica, call, (replica.client,), False))
            except ExecutorError as err:
                if not moves_sequence(err):
                    raise
                self._mark(replica, err)
                last = err
        raise FailoverFailed(f"no replica answered ({last})", cause=last, attempts=len(order))

    def _release_name_flow(self, name: str) -> Flow:
        """Releases a request_id on every replica (names are per server, and a call whose
        reply was lost may have run on any replica it was tried on); the blocks freed."""
        freed = 0
        for replica in self._fleet.replicas:
            try:
                freed += yield _Call(replica, replica.client.release_cache, (None, name))
            except ExecutorError as err:
                if not moves_sequence(err):
                    raise
        return freed

    def _release_flow(self, cache: KvCacheHandle | str) -> Flow:
        if isinstance(cache, KvCacheHandle):
            seq, _ = self._fleet.resolve(cache)
            if seq is None:
                owner = yield from self._owner_flow(cache)
                return (yield _Call(owner, owner.client.release_cache, (cache,)))
        else:
            seq = self._fleet.by_cache_id(cache)
            if seq is None:  # an id this client never saw: ask each replica
                last = None
                for replica in self._fleet.replicas:
                    try:
                        return (yield _Call(replica, replica.client.release_cache, (cache,)))
                    except ExecutorError as err:
                        last = err
                raise last
        try:
            freed = yield _Call(seq.replica, seq.replica.client.release_cache, (seq.handle,))
        except ExecutorError as err:
            if not moves_sequence(err):
                raise
            # Its server is gone, restarted or stopping: the blocks go with it.
            log.info("released %s with its replica %s gone (%s)", seq.handle.cache_id, seq.replica.target, err)
            freed = 0
        self._fleet.forget(seq)
        return freed

    def _fork_flow(self, handle: KvCacheHandle, num_children: int) -> Flow:
        seq, _ = self._fleet.resolve(handle)
        children = yield from self._sequence_flow(
            handle, lambda client, h: client.fork_cache(h, num_children), lambda out: (),
            result_handle=lambda out: seq.handle if seq is not None else None)
        if seq is not None:
            for child in children:
                history = seq.tokens[:child.sequence_length] if seq.tokens is not None else None
                spans = list(seq.spans)
                shrink_spans(spans, child.sequence_length)
                self._fleet.track(seq.replica, history, child, spans)
        return children


def _entries(items: Iterable[DecodeItem]) -> list[tuple[list[int], KvCacheHandle]]:
    pairs = [(i.token_id, i.kv_cache) if isinstance(i, DecodeInput) else i for i in items]
    return [([token], handle) for token, handle in pairs]


def _prompt_entries(prompts: Iterable[Prompt]) -> list[tuple[list[int], KvCacheHandle | None]]:
    return [(list(tokens), handle) for tokens, handle in map(split_prompt, prompts)]


def _item_choices(items: list, token_choice: TokenChoice | None) -> list[TokenChoice | None]:
    """Each decode item's token choice: its own (DecodeInput.token_choice), else ``token_choice``."""
    return [i.token_choice if isinstance(i, DecodeInput) and i.token_choice is not None else token_choice
            for i in items]


def _prompt_choices(count: int, token_choice) -> list[TokenChoice | None]:
    """batch_prefill's ``token_choice``: one for every prompt, or one per prompt."""
    if token_choice is None or isinstance(token_choice, TokenChoice):
        return [token_choice] * count
    choices = list(token_choice)
    if len(choices) != count:
        raise ValueError(f"{len(choices)} token choices for {count} prompts")
    return choices


def _export_header(data):
    """The header of an export held as bytes (None for a file: it is read once, as it goes)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        return None
    first = next(iter(sequence_file.messages(data)), None)
    return first.header if first is not None and first.HasField("header") else None


# -- the public calls, once --------------------------------------------------------------------


class _Contract:
    """A replica set's public calls, each written once as a flow (the replica set is
    ``self``); :class:`ReplicaSetClient` and :class:`AsyncReplicaSetClient` get one
    method per function here (:data:`DRIVEN`), which drives the flow."""

    def replica_of(self, handle: KvCacheHandle):
        """The target that owns ``handle``'s sequence now (after any failover); a handle
        this client does not track goes by its instance id, replicas not yet asked
        probed first (StaleHandle when it is none of them)."""
        seq, _ = self._fleet.resolve(handle)
        owner = seq.replica if seq is not None else (yield from self._owner_flow(handle))
        return owner.target

    def replica_status(self):
        """Every replica's GetStatus now (or the error asking it gave)."""
        return {r.target: out for r, out in zip(self._fleet.replicas, (yield from self._statuses_flow()))}

    def wait_ready(self, timeout: float = 30.0):
        """Waits until every replica serves the model (each within ``timeout``; see
        ``ExecutorClient.wait_ready``)."""
        for replica in self._fleet.replicas:
            yield _Call(replica, replica.client.wait_ready, (timeout,), False)

    def info(self):
        return (yield from self._any_flow(lambda c: c.info()))

    def capabilities(self):
        return (yield from self._any_flow(lambda c: c.capabilities()))

    def status(self):
        """One usable replica's status (see :meth:`replica_status` for all)."""
        return (yield from self._any_flow(lambda c: c.status()))

    def prefill(self, token_ids: Sequence[int], kv_cache: KvCacheHandle | None = None,
                logits: LogitsPolicy | None = None, hidden_states: HiddenStatesRequest | None = None,
                token_choice: TokenChoice | None = None, request_id: str | None = None):
        """A new prompt placed by load (or prefix locality); a continuation on its owner."""
        tokens = list(token_ids)
        if kv_cache is None:
            return (yield from self._new_sequence_flow(
                tokens, lambda c: c.prefill(tokens, None, logits, hidden_states, token_choice, request_id)))
        return (yield from self._sequence_flow(
            kv_cache, lambda c, h: c.prefill(tokens, h, logits, hidden_states, token_choice, request_id),
            lambda out: tokens, prompt=True))

    def decode(self, token_id: int, kv_cache: KvCacheHandle, logits: LogitsPolicy | None = None,
               token_choice: TokenChoice | None = None):
        return (yield from self._sequence_flow(
            kv_cache, lambda c, h: c.decode(token_id, h, logits, token_choice), lambda out: [token_id]))

    def batch_decode(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                     token_choice: TokenChoice | None = None):
        """One batched forward per owning replica, in parallel; outputs in the order of ``items``."""
        items = list(items)
        choices = _item_choices(items, token_choice)

        def call_for(replica, group):
            return _Call(replica, replica.client.batch_decode,
                         ([DecodeInput(i.tokens[0], i.send, choices[i.index]) for i in group], logits))
        return (yield from self._batch_flow(_entries(items), call_for))

    def decode_ahead(self, token_id: int, kv_cache: KvCacheHandle, token_choice: TokenChoice,
                     max_new_tokens: int, stop_token_ids: Sequence[int] = (), on_token=None):
        """Decoding ahead on the sequence's owner (:meth:`ExecutorClient.decode_ahead`).  If
        the owner is lost mid-run, the sequence is rebuilt elsewhere from its history and
        the run goes on there from the last token received: the tokens already emitted
        are appended first, so a greedy or seeded choice gives the tokens the lost run
        would have given (an unseeded one draws afresh from there)."""
        got, stopped = [], [False]

        def op(client, send):
            run = run_ahead_async if isinstance(client, AsyncExecutorClient) else run_ahead
            return run(client, send, token_id, token_choice, max_new_tokens, stop_token_ids, got, on_token, stopped)
        return (yield from self._sequence_flow(
            kv_cache, op, lambda out: [token_id] + [c.token_id for c in out.chosen[:-1]]))

    def forward_verify(self, token_ids: Sequence[int], kv_cache: KvCacheHandle,
                       logits: LogitsPolicy = LogitsPolicy()):
        tokens = list(token_ids)
        return (yield from self._sequence_flow(
            kv_cache, lambda c, h: c.forward_verify(tokens, h, logits), lambda out: tokens))

    def speculative_decode(self, token_id: int, draft: Sequence[int], kv_cache: KvCacheHandle,
                           logits: LogitsPolicy | None = None, sampling: SpeculativeSampling | None = None,
                           token_choice: TokenChoice | None = None):
        return (yield from self._sequence_flow(
            kv_cache, lambda c, h: c.speculative_decode(token_id, draft, h, logits, sampling, token_choice),
            lambda out: [token_id, *out.accepted_token_ids]))

    def batch_prefill(self, prompts: Iterable[Prompt], logits: LogitsPolicy | None = None,
                      token_choice: TokenChoice | Sequence[TokenChoice | None] | None = None):
        """New prompts placed by load, continuations on their owners; one call per replica."""
        prompts = list(prompts)
        choices = _prompt_choices(len(prompts), token_choice)

        def call_for(replica, group):
            return _Call(replica, replica.client.batch_prefill,
                         ([i.tokens if i.send is None else (i.tokens, i.send) for i in group], logits,
                          [choices[i.index] for i in group]))
        return (yield from self._batch_flow(_prompt_entries(prompts), call_for, prompt=True))

    def truncate_kv(self, kv_cache: KvCacheHandle, new_length: int):
        return (yield from self._sequence_flow(
            kv_cache, lambda c, h: c.truncate_kv(h, new_length), lambda out: (), result_handle=lambda out: out,
            keep=new_length))

    def release_cache(self, cache: KvCacheHandle | str | None = None, request_id: str | None = None):
        if request_id is not None:
            return (yield from self._release_name_flow(request_id))
        return (yield from self._release_flow(cache))

    def fork_cache(self, kv_cache: KvCacheHandle, num_children: int):
        return (yield from self._fork_flow(kv_cache, num_children))

    def list_models(self):
        return (yield from self._any_flow(lambda c: c.list_models()))

    def load_model(self, name: str, path: str, progress=None):
        """Loads the model on every replica, one after another."""
        for replica in self._fleet.replicas:
            yield _Call(replica, replica.client.load_model, (name, path, progress), False)

    def unload_model(self, name: str):
        """Unloads the model on every replica; returns the sequences dropped in all."""
        dropped = 0
        for replica in self._fleet.replicas:
            dropped += yield _Call(replica, replica.client.unload_model, (name,), False)
        return dropped

    def export_sequence(self, kv_cache: KvCacheHandle, file=None, chunk_bytes: int = 0):
        """Reads the sequence out of the replica that owns it (see ExecutorClient.export_sequence)."""
        seq, send = self._fleet.resolve(kv_cache)
        replica = seq.replica if seq is not None else (yield from self._owner_flow(kv_cache))
        return (yield _Call(replica, replica.client.export_sequence, (send, file, chunk_bytes)))

    def import_sequence(self, data):
        """Into a replica placed as for a new sequence, and tracked from then on (its history,
        for a replay, is the export's when ``data`` is bytes; a file's is not kept)."""
        header = _export_header(data)
        tokens = list(header.token_ids) if header is not None else None
        replica = yield from self._place_flow(tokens or [], role=DECODE)
        if replica is None:
            replica = min(self._fleet.replicas, key=lambda r: r.unusable_until)
        handle = yield _Call(replica, replica.client.import_sequence, (data,))
        spans = list(zip(header.prompt_spans[::2], header.prompt_spans[1::2])) if header is not None else []
        self._fleet.track(replica, tokens, handle, spans)
        return handle

    def create_import_ticket(self, fingerprint: str = "", ttl_s: float = 0.0):
        raise ExecutorError("an import ticket belongs to one server: ask that server's single-target client",
                            code=grpc.StatusCode.FAILED_PRECONDITION)
        yield  # never reached: makes this a flow

    def push_sequence(self, kv_cache: KvCacheHandle, target: str, ticket: str, move: bool = False,
                      chunk_bytes: int = 0):
        """The owner pushes the sequence to ``target``; a move stops tracking it here."""
        seq, send = self._fleet.resolve(kv_cache)
        replica = seq.replica if seq is not None else (yield from self._owner_flow(kv_cache))
        out = yield _Call(replica, replica.client.push_sequence, (send, target, ticket, move, chunk_bytes))
        if seq is not None and out.released:
            self._fleet.forget(seq)
        return out

    def shared_memory(self, byte_size: int, name: str | None = None):
        raise ExecutorError("shared-memory regions belong to one server: open them on a single-target client",
                            code=grpc.StatusCode.FAILED_PRECONDITION)
        yield  # never reached: makes this a flow


_RESULTS = {rpc.name: rpc.returns for rpc in RPCS}  # a replica set's calls return what a server's do
_RESULTS["decode_ahead"] = AheadResult


def _driven(flow: Callable[..., Flow], name: str | None = None) -> Callable[[bool], Callable]:
    """``make(aio)`` for the method (named ``name``, by default the flow's) that runs
    ``flow`` with its object's ``_drive``."""
    name = name or flow.__name__
    return lambda aio: method(name, flow, _RESULTS.get(name, inspect.Signature.empty),
                              lambda self, *args, **kwargs: self._drive(flow(self, *args, **kwargs)), aio)


# What ReplicaSetClient and AsyncReplicaSetClient get: a method per call of _Contract.
DRIVEN = {name: _driven(flow) for name, flow in vars(_Contract).items() if inspect.isfunction(flow)}


# -- the drivers ---------------------------------------------------------------------------------


@dataclass
class _Done:
    """A flow returned ``value``."""

    value: Any


def _resume(flow: Flow, outcome: Any) -> Any:
    """Resumes ``flow`` with its last request's outcome (a value, or an ExecutorError to
    raise in it): its next request, or :class:`_Done` with what it returned."""
    try:
        return flow.throw(outcome) if isinstance(outcome, ExecutorError) else flow.send(outcome)
    except StopIteration as stop:
        return _Done(stop.value)


class _SyncDriver:
    """Runs flows on the caller's thread; parallel calls on a small pool."""

    _fleet: _Fleet
    _pool: ThreadPoolExecutor

    def _drive(self, flow: Flow) -> Any:
        request = _resume(flow, None)
        while not isinstance(request, _Done):
            if isinstance(request, _Call):
                outcome = self._outcome(request)
            elif isinstance(request, _Parallel):
                calls = request.calls
                outcome = [self._outcome(calls[0])] if len(calls) == 1 else list(self._pool.map(self._outcome, calls))
            else:
                time.sleep(request.seconds)
                outcome = None
            request = _resume(flow, outcome)
        return request.value

    def _run(self, call: _Call) -> Any:
        if call.counted:
            with self._fleet.lock:
                call.replica.inflight += 1
        try:
            return call.fn(*call.args)
        finally:
            if call.counted:
                with self._fleet.lock:
                    call.replica.inflight -= 1

    def _outcome(self, call: _Call) -> Any:
        try:
            return self._run(call)
        except ExecutorError as err:
            return err


class _AsyncDriver:
    """Awaits flows on the event loop; parallel calls gathered."""

    async def _drive(self, flow: Flow) -> Any:
        request = _resume(flow, None)
        while not isinstance(request, _Done):
            if isinstance(request, _Call):
                outcome = await self._outcome(request)
            elif isinstance(request, _Parallel):
                outcome = list(await asyncio.gather(*(self._outcome(c) for c in request.calls)))
            else:
                await asyncio.sleep(request.seconds)
                outcome = None
            request = _resume(flow, outcome)
        return request.value

    async def _run(self, call: _Call) -> Any:
        if call.counted:
            call.replica.inflight += 1
        try:
            value = call.fn(*call.args)
            return await value if inspect.isawaitable(value) else value
        finally:
            if call.counted:
                call.replica.inflight -= 1

    async def _outcome(self, call: _Call) -> Any:
        try:
            return await self._run(call)
        except ExecutorError as err:
            return err


# -- the clients -------------------------------------------------------------------------------


class _ReplicaSessions:
    """A DecodeSession over a replica set: one stream per owning replica, opened on
    first use; a step is split by owner, run in parallel and merged in order."""

    def __init__(self, client: _Routing):
        self._client = client
        self._sessions: dict[_Replica, Any] = {}
        self._lock = threading.Lock()

    @property
    def _drive(self):
        return self._client._drive

    def _session(self, replica: _Replica):
        with self._lock:
            if replica not in self._sessions:
                self._sessions[replica] = replica.client.decode_session()
            return self._sessions[replica]

    def _step_flow(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                   token_choice: TokenChoice | None = None) -> Flow:
        """One step: split by owner, one stream step per replica in parallel, merged in order."""
        items = list(items)
        choices = _item_choices(items, token_choice)

        def call_for(replica, group):
            return _Call(replica, self._session(replica).step,
                         ([DecodeInput(i.tokens[0], i.send, choices[i.index]) for i in group], logits))
        return (yield from self._client._batch_flow(_entries(items), call_for, self._lost))

    def _lost(self, replica: _Replica) -> None:
        """Drops the stream to a replica that cannot hold its sequences any more."""
        raise NotImplementedError


class ReplicaDecodeSession(_ReplicaSessions):
    __doc__ = _ReplicaSessions.__doc__

    step = _driven(_ReplicaSessions._step_flow, "step")(False)

    def _lost(self, replica: _Replica) -> None:
        with self._lock:
            session = self._sessions.pop(replica, None)
        if session is not None:
            try:
                session.close()
            except (ExecutorError, grpc.RpcError) as err:
                log.debug("closing the session on %s: %s", replica.target, err)

    def close(self) -> None:
        for replica in list(self._sessions):
            self._lost(replica)

    def __enter__(self) -> ReplicaDecodeSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncReplicaDecodeSession(_ReplicaSessions):
    """:class:`ReplicaDecodeSession` for asyncio."""

    step = _driven(_ReplicaSessions._step_flow, "step")(True)

    def _lost(self, replica: _Replica) -> None:
        session = self._sessions.pop(replica, None)
        if session is not None:
            session._call.cancel()  # its stream is dead or its server is stopping

    async def close(self) -> None:
        for replica in list(self._sessions):
            session = self._sessions.pop(replica)
            try:
                await session.close()
            except (ExecutorError, grpc.RpcError) as err:
                log.debug("closing the session on %s: %s", replica.target, err)

    async def __aenter__(self) -> AsyncReplicaDecodeSession:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


@with_methods(DRIVEN, aio=False)
class ReplicaSetClient(_SyncDriver, _Routing):
    """:class:`ExecutorClient`'s methods over several replicas, each reached through its
    own ExecutorClient; :func:`connect` builds one for several targets.

    New sequences are placed by load (power of two choices over cached GetStatus
    answers) or prefix locality; every call on a handle goes to its owner; batches
    and sessions are split by owner and merged back in order; with ``failover``
    (the default) a sequence whose owner dies, restarts or drains is replayed on
    another replica and the call goes on there (logged; bounded by the policy;
    :class:`~ferrum_rpc.errors.FailoverFailed` when it cannot be).  Thread-safe
    across sequences; each sequence is used by one thread at a time.
    """

    _client_class = ExecutorClient
    _session_class = ReplicaDecodeSession

    def _opened(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(2, len(self._fleet.replicas)), thread_name_prefix="replicas")

    def close(self) -> None:
        self._close_router()
        for replica in self._fleet.replicas:
            replica.client.close()
        self._pool.shutdown(wait=False)

    def __enter__(self) -> ReplicaSetClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@with_methods(DRIVEN, aio=True)
class AsyncReplicaSetClient(_AsyncDriver, _Routing):
    """:class:`ReplicaSetClient` for asyncio, over AsyncExecutorClients: the same methods, awaitable."""

    _client_class = AsyncExecutorClient
    _session_class = AsyncReplicaDecodeSession

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self._close_router)
        for replica in self._fleet.replicas:
            await replica.client.close()

    async def __aenter__(self) -> AsyncReplicaSetClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def connect(target: str | Sequence[str], **options) -> ExecutorClient | ReplicaSetClient:
    """A blocking client for ``target``: an :class:`ExecutorClient` for one server, a
    :class:`ReplicaSetClient` when it names several (a list of targets, or gRPC's
    multi-address forms: "ipv4:10.0.0.1:5001,10.0.0.2:5001", "ipv6:[::1]:5001,[::1]:5002",
    "dns:///host:port" resolving to several addresses).  ``options``: the keywords of
    :class:`ExecutorClient` (``failover`` and ``replica_policy`` matter to a replica set)."""
    return (ReplicaSetClient if len(resolve_targets(target)) > 1 else ExecutorClient)(target, **options)


def connect_async(target: str | Sequence[str], **options) -> AsyncExecutorClient | AsyncReplicaSetClient:
    """:func:`connect` for asyncio: an :class:`AsyncExecutorClient` or an :class:`AsyncReplicaSetClient`."""
    return (AsyncReplicaSetClient if len(resolve_targets(target)) > 1 else AsyncExecutorClient)(target, **options)
