"""Where a new sequence goes, and what the client knows of each replica's health.

New sequences go where there is room: the better of two random replicas by their
cached GetStatus (queue depth, KV blocks), unless the replica whose prefix cache
holds the prompt's leading blocks (KV events, else the first-tokens LRU) is not much
more loaded (locality).  A replica that fails a call is left out for a cooldown and
probed again before it is used.  Queries that any replica can answer go to the
first usable one.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Sequence

import grpc

from .actions import Flow, _Call, _Parallel, _Sleep
from .policy import moves_sequence
from ..disagg import PREFILL
from ..fleet import _Replica
from ferrum_rpc.errors import AdapterNotFound, ExecutorError, FailoverFailed, KvCapacityExhausted, Reason, StaleHandle
from ferrum_rpc.types import KvCacheHandle, ServerState

log = logging.getLogger(__name__)


class Placement:
    """Placement, probes and the bounds of a retry, as flows (part of :class:`~.routing._Routing`,
    whose state they read: ``_fleet``, ``policy``, ``failover``, ``_roles``, ``_router``, ``clock``)."""

    def __init__(self, routing):
        self.r = routing  # the state the flows read and change

    def preferred(self, tokens: Sequence[int], adapter: str = "") -> _Replica | None:
        """The replica whose cache holds the longest run of ``tokens``' leading blocks for
        ``adapter`` (by its KV events; the less loaded of equals), else the first-tokens LRU's."""
        fleet = self.r._fleet
        if self.r._router is not None:
            matched = self.r._router.matched_tokens(tokens, adapter)
            longest = max(matched.values(), default=0)
            if longest:
                holders = [r for r in fleet.replicas if matched.get(r.target) == longest]
                return min(holders, key=lambda r: r.load() if r.status is not None else 0.0)
        return fleet.preferred(fleet.prefix_key(tokens))

    # -- replica state --------------------------------------------------------------
    def mark(self, replica: _Replica, err: ExecutorError, unanswered: bool = False) -> None:
        """Leaves a replica out of placement for a while (or, for a restart, asks it again);
        ``unanswered``: a status probe's deadline passed (a hung or unreachable host)."""
        if err.reason is Reason.STALE_HANDLE:
            replica.status_at = float("-inf")  # a new instance: ask for its status before using it
            return
        if isinstance(err, KvCapacityExhausted) or not (moves_sequence(err) or unanswered):
            return
        if replica.healthy:  # once per outage; the probes after each cooldown log at debug level
            log.warning("replica %s left out (asked again every %.1fs): %s", replica.target,
                        self.r.policy.down_cooldown_s, err)
        else:
            log.debug("replica %s still left out: %s", replica.target, err)
        replica.healthy, replica.status_at = False, float("-inf")  # probed before it is used again
        replica.unusable_until = self.r.clock() + self.r.policy.down_cooldown_s

    def probe_flow(self, replicas: list[_Replica]) -> Flow:
        """Refreshes the status of ``replicas`` (in parallel); leaves out those not serving."""
        results = yield _Parallel([_Call(r, "_status_probe", (self.r.policy.probe_timeout_s,), False)
                                   for r in replicas])
        for replica, result in zip(replicas, results):
            if isinstance(result, ExecutorError):
                self.mark(replica, result, unanswered=result.code is grpc.StatusCode.DEADLINE_EXCEEDED)
                continue
            if result.server_instance_id != replica.instance_id or not replica.block_size:
                try:
                    caps = yield _Call(replica, "capabilities", (), False)
                except ExecutorError as err:
                    self.mark(replica, err)
                    continue
                replica.block_size = caps.kv_block_size
                if replica.instance_id and result.server_instance_id != replica.instance_id:
                    log.info("replica %s is a new instance (%s, was %s)", replica.target,
                             result.server_instance_id, replica.instance_id)
            replica.status, replica.status_at, replica.placed_tokens = result, self.r.clock(), 0
            replica.instance_id = result.server_instance_id
            if result.state is not ServerState.SERVING:
                if replica.healthy:
                    log.info("replica %s is %s; placing elsewhere", replica.target, result.state.name.lower())
                replica.healthy = False
                replica.unusable_until = self.r.clock() + self.r.policy.down_cooldown_s
            elif not replica.healthy:
                log.info("replica %s is serving again", replica.target)
                replica.healthy = True

    def place_flow(self, tokens: Sequence[int], exclude: set[_Replica] = frozenset(),
                    role: str | None = None, adapter: str = "") -> Flow:
        """The replica a new sequence of ``tokens`` (running ``adapter``) goes to, or None
        when none is usable: the better of two random usable replicas by load, or the
        prefix's replica (locality) unless it is more loaded than that by
        ``locality_slack``; with replica roles, one that does ``role``'s work if any is usable."""
        if role is not None and self.r._roles.enabled:
            place = functools.partial(self.place_flow, adapter=adapter)
            return (yield from self.r._roles.place_flow(place, tokens, exclude, role))
        fleet, policy = self.r._fleet, self.r.policy
        preferred = self.preferred(tokens, adapter)
        tried: set[_Replica] = set(exclude)
        while True:
            now = self.r.clock()
            candidates = [r for r in fleet.replicas if r not in tried and r.usable(now)]
            if not candidates:
                return None
            picks = fleet.random.sample(candidates, min(2, len(candidates)))
            local = preferred if preferred in candidates and preferred not in picks else None
            asked = picks + ([local] if local else [])
            stale = [r for r in asked if not r.fresh(now, policy.status_ttl_s)]
            if stale:
                yield from self.probe_flow(stale)
            now = self.r.clock()
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
    def new_sequence_flow(self, tokens: list[int], call: Callable[[_Replica], _Call], adapter: str = "") -> Flow:
        """Runs ``call(replica)`` (a prefill of ``tokens``) on a placed replica; with failover,
        a replica that cannot take it (unreachable, draining, full) is left out and
        the next one tried, within the policy's bounds."""
        exclude: set[_Replica] = set()
        start, attempts, last = self.r.clock(), 0, None
        while True:
            replica = yield from self.place_flow(tokens, exclude, PREFILL, adapter)
            if replica is None and not self.r.failover:  # no retries: let the server answer
                replica = min(self.r._fleet.replicas, key=lambda r: r.unusable_until)
            if replica is None:
                attempts += 1
                yield from self.wait_or_fail(start, attempts, last, "place a new sequence")
                exclude.clear()
                continue
            attempts += 1
            try:
                out = yield call(replica)
            except ExecutorError as err:
                # a replica that is full, or lacks the prompt's adapter, leaves it to another
                if not self.r.failover or not (moves_sequence(err) or isinstance(err, (KvCapacityExhausted,
                                                                                    AdapterNotFound))):
                    raise
                self.mark(replica, err)
                exclude.add(replica)
                last = err
                self.check_bounds(start, attempts, last, "place a new sequence")
                continue
            self.r._fleet.track(replica, tokens, out.kv_cache)
            self.r._fleet.remember_prefix(tokens, replica)
            return out

    def check_bounds(self, start: float, attempts: int, last: ExecutorError | None, what: str) -> None:
        elapsed = self.r.clock() - start
        if attempts >= self.r.policy.max_attempts or elapsed >= self.r.policy.failover_timeout_s:
            raise FailoverFailed(f"could not {what}: {attempts} replica(s) tried in {elapsed:.1f}s"
                                 + (f"; last error {last}" if last else ""), cause=last, attempts=attempts)

    def wait_or_fail(self, start: float, attempts: int, last: ExecutorError | None, what: str) -> Flow:
        """No replica is usable now (a round that counts as an attempt): waits for the first
        to come off its cooldown, within the policy's bounds, or raises FailoverFailed."""
        elapsed = self.r.clock() - start
        wake = min(r.unusable_until for r in self.r._fleet.replicas) - self.r.clock()
        if attempts >= self.r.policy.max_attempts or elapsed + max(wake, 0.0) >= self.r.policy.failover_timeout_s:
            raise FailoverFailed(f"could not {what}: no replica usable after {elapsed:.1f}s and {attempts} "
                                 f"tries (bounds: {self.r.policy.max_attempts} tries, "
                                 f"{self.r.policy.failover_timeout_s:.1f}s)"
                                 + (f"; last error {last}" if last else ""), cause=last, attempts=attempts)
        yield _Sleep(max(wake, 0.01))

    # -- owners and queries -----------------------------------------------------------------
    def owner_flow(self, handle: KvCacheHandle) -> Flow:
        """The replica a handle this client does not track belongs to (by instance id)."""
        owner = self.r._fleet.owner(handle)
        if owner is None:
            unknown = [r for r in self.r._fleet.replicas if not r.instance_id]
            if unknown:
                yield from self.probe_flow(unknown)
                owner = self.r._fleet.owner(handle)
        if owner is None:
            raise StaleHandle(f"handle {handle.cache_id!r} is from server instance "
                              f"{handle.server_instance_id!r}, which is none of this client's replicas")
        return owner

    def any_flow(self, method: str, args: tuple = ()) -> Flow:
        """The client method ``method`` on the first usable replica that answers (queries)."""
        now, last = self.r.clock(), None
        order = sorted(self.r._fleet.replicas, key=lambda r: not r.usable(now))
        for replica in order:
            try:
                return (yield _Call(replica, method, args, False))
            except ExecutorError as err:
                if not moves_sequence(err):
                    raise
                self.mark(replica, err)
                last = err
        raise FailoverFailed(f"no replica answered ({last})", cause=last, attempts=len(order))

    def statuses_flow(self) -> Flow:
        """Every replica's status now, or the error asking it gave."""
        return (yield _Parallel([_Call(r, "_status_probe", (self.r.policy.probe_timeout_s,), False)
                                 for r in self.r._fleet.replicas]))
