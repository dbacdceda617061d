"""Calls on one sequence: affinity, and the failover that keeps the sequence alive.

A handle names its server instance, so every call on a sequence goes to the replica
that owns it.  Since the client remembers every token it has sent on a live sequence
(prompt, decoded tokens, truncations; forks copy the history), it can rebuild the
sequence on another replica when the owner dies (UNAVAILABLE), restarts
(STALE_HANDLE) or drains (DRAINING): by migration from a draining owner (its KV
pushed, nothing recomputed), else by replaying the history, the tokens Prefills
appended as Prefills and the rest (decoded, verified) as ForwardVerify calls, so the
rebuilt sequence splits prompt from output as the server did.  A call that timed out
here but ran there after all leaves the server's copy out of step (LENGTH_MISMATCH on
the next call): the sequence is rebuilt from the history this client knows (a resync).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, Callable, Sequence

import grpc

from .actions import Flow, _Call
from .policy import REPLAY_LOGITS, moves_sequence
from ..disagg import DECODE
from ..fleet import _key, _Replica, _Sequence, replay_pieces, shrink_spans
from ferrum_rpc.errors import ExecutorError, FailoverFailed, KvCapacityExhausted, Reason
from ferrum_rpc.types import KvCacheHandle

log = logging.getLogger(__name__)


class Failover:
    """Calls on one sequence and its moves (replay, migration, resync) as flows (part of
    :class:`~.routing._Routing`; placement comes from :class:`~.placement.Placement`)."""

    def __init__(self, routing):
        self.r = routing  # the state the flows read and change

    def sequence_flow(self, handle: KvCacheHandle, call: Callable[[_Replica, KvCacheHandle], _Call],
                       added: Callable[[Any], Sequence[int]], result_handle=lambda out: out.kv_cache,
                       keep: int | None = None, prompt: bool = False) -> Flow:
        """``call(replica, handle)`` on the sequence's owner.  On success the sequence's history
        grows by ``added(output)`` (after the first ``keep`` tokens, for a truncation;
        by default all that the handle sent holds).  When the owner cannot hold the sequence any more, its history is
        replayed elsewhere and the call runs there."""
        seq, send = self.r._fleet.resolve(handle)
        if seq is not None and not prompt:
            send = yield from self.r._roles.handoff_flow(self.r.placement.place_flow, self.migrate_flow, seq, send)
        replica = seq.replica if seq is not None else (yield from self.r.placement.owner_flow(handle))
        for round_ in range(self.r.policy.max_attempts + 1):
            try:
                out = yield call(replica, send)
            except ExecutorError as err:
                if seq is not None and err.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                    seq.unsure = True  # it may have run after all: the next call checks
                if seq is None or not self.r.failover or round_ == self.r.policy.max_attempts:
                    raise
                if self.resyncs(seq, err):
                    send = yield from self.resync_flow(seq, send, err)
                elif moves_sequence(err):
                    self.r.placement.mark(replica, err)
                    send = yield from self.replay_flow(seq, send, err)
                else:
                    raise
                replica = seq.replica
                continue
            if seq is not None:
                new = result_handle(out)
                self.r._fleet.advance(seq, send.sequence_length if keep is None else keep, added(out), new, prompt)
            return out

    def fork_flow(self, handle: KvCacheHandle, num_children: int) -> Flow:
        """Forks on the owner; each child is tracked with its parent's history."""
        seq, _ = self.r._fleet.resolve(handle)
        children = yield from self.sequence_flow(
            handle, lambda r, h: _Call(r, "fork_cache", (h, num_children)), lambda out: (),
            result_handle=lambda out: seq.handle if seq is not None else None)
        if seq is not None:
            for child in children:
                history = seq.tokens[:child.sequence_length] if seq.tokens is not None else None
                spans = list(seq.spans)
                shrink_spans(spans, child.sequence_length)
                self.r._fleet.track(seq.replica, history, child, spans)
        return children

    def rebuild_flow(self, replica: _Replica, seq: _Sequence) -> Flow:
        """``seq``'s history on ``replica``: its prompt spans as Prefills, the tokens after
        them as ForwardVerify (output), so the server splits prompt from output as
        before; returns the last call's output.  A half-built copy is released unless
        the replica is gone."""
        tokens = seq.tokens.tolist()
        handle, out = None, None
        try:
            for start, end, prompt in replay_pieces(len(tokens), seq.spans):
                args = (tokens[start:end], handle, REPLAY_LOGITS)
                if handle is None and seq.handle.adapter:  # the copy runs the sequence's adapter too
                    args += (None, None, None, seq.handle.adapter)
                out = yield _Call(replica, "prefill" if prompt else "forward_verify", args)
                handle = out.kv_cache
        except ExecutorError as err:
            if handle is not None and not moves_sequence(err):
                try:
                    yield _Call(replica, "release_cache", (handle,), False)
                except ExecutorError as release_err:  # left to the server's idle timeout
                    log.info("could not release a half-replayed %s on %s: %s", handle.cache_id,
                             replica.target, release_err)
            raise
        return out

    def replay_flow(self, seq: _Sequence, send: KvCacheHandle, cause: ExecutorError) -> Flow:
        """Rebuilds ``seq`` on a healthy replica by replaying its history (``_rebuild_flow``);
        returns the handle to send there (with the caller's length).  Raises FailoverFailed."""
        if cause.reason is Reason.DRAINING and self.r.policy.migrate:
            moved = yield from self.migrate_flow(seq, send, f"drain: {cause}")
            if moved is not None:
                return moved
        if not seq.tokens:
            raise FailoverFailed(f"sequence {seq.handle.cache_id!r} cannot be moved: its history is not known "
                                 f"({cause})", cause=cause)
        old = seq.replica
        # A restarted replica may take it back; so may one that is fine but whose copy is out of step (a resync).
        exclude = set() if cause.reason in (Reason.STALE_HANDLE, Reason.LENGTH_MISMATCH) else {old}
        start, attempts, last = self.r.clock(), 0, cause
        what = f"move sequence {seq.handle.cache_id!r} ({len(seq.tokens)} tokens) off {old.target}"
        while True:
            replica = yield from self.r.placement.place_flow(seq.tokens, exclude, DECODE, seq.handle.adapter)
            if replica is None:
                attempts += 1
                yield from self.r.placement.wait_or_fail(start, attempts, last, what)
                exclude.clear()
                continue
            attempts += 1
            try:
                out = yield from self.rebuild_flow(replica, seq)
            except ExecutorError as err:
                if not (moves_sequence(err) or isinstance(err, KvCapacityExhausted)):
                    raise FailoverFailed(f"could not {what}: {err}", cause=err, attempts=attempts) from err
                self.r.placement.mark(replica, err)
                exclude.add(replica)
                last = err
                self.r.placement.check_bounds(start, attempts, last, what)
                continue
            self.r._fleet.rebind(seq, replica, out.kv_cache)
            self.r._fleet.remember_prefix(seq.tokens, replica)
            log.warning("failover: sequence %s (%d tokens) moved from %s to %s as %s in %.1f ms (%s)",
                        send.cache_id, len(seq.tokens), old.target, replica.target, out.kv_cache.cache_id,
                        1e3 * (self.r.clock() - start), cause)
            return replace(out.kv_cache, sequence_length=send.sequence_length)

    def migrate_flow(self, seq: _Sequence, send: KvCacheHandle, why: str, replica: _Replica | None = None) -> Flow:
        """Moves ``seq`` off its owner by a push (its KV, bit for bit) to ``replica``, by
        default one placed as for a replay; returns the handle to send there (with the
        caller's length), or None when it could not (the sequence stays where it is)."""
        old, start = seq.replica, self.r.clock()
        if replica is None:
            replica = yield from self.r.placement.place_flow(seq.tokens if seq.tokens is not None else [], {old}, DECODE,
                                                  seq.handle.adapter)
        if replica is None:
            return None
        try:
            ticket = yield _Call(replica, "create_import_ticket", (), False)
            out = yield _Call(old, "push_sequence", (seq.handle, replica.target, ticket.ticket, True), False)
        except ExecutorError as err:
            log.info("could not migrate %s off %s (%s)", seq.handle.cache_id, old.target, err)
            return None
        if not out.released:  # it changed on the owner meanwhile: the copy is not it
            try:
                yield _Call(replica, "release_cache", (out.kv_cache,), False)
            except ExecutorError as err:  # left to the server's idle timeout
                log.info("could not release a stale migrated copy on %s: %s", replica.target, err)
            return None
        self.r._fleet.rebind(seq, replica, out.kv_cache)
        if seq.tokens is not None:
            self.r._fleet.remember_prefix(seq.tokens, replica)  # its full blocks are in the new replica's cache
        log.warning("sequence %s (%d tokens) migrated from %s to %s as %s in %.1f ms, %d bytes (%s)",
                    send.cache_id, out.kv_cache.sequence_length, old.target, replica.target, out.kv_cache.cache_id,
                    1e3 * (self.r.clock() - start), out.bytes_sent, why)
        return replace(out.kv_cache, sequence_length=send.sequence_length)

    @staticmethod
    def resyncs(seq: _Sequence | None, err: ExecutorError) -> bool:
        """Whether ``err`` on a call on ``seq`` means its copy on the server is out of step
        with this client because a call that timed out here ran there after all."""
        return seq is not None and seq.unsure and bool(seq.tokens) and err.reason is Reason.LENGTH_MISMATCH

    def resync_flow(self, seq: _Sequence, send: KvCacheHandle, cause: ExecutorError) -> Flow:
        """Rebuilds ``seq`` from the history this client knows (a replay, on any replica,
        its own included) and releases the copy of unknown length it had; returns the
        handle to send (with the caller's length)."""
        old_replica, old_handle = seq.replica, seq.handle
        seq.unsure = False
        log.warning("sequence %s: a call that timed out here ran on %s after all (%s); rebuilding it from "
                    "its %d remembered tokens", old_handle.cache_id, old_replica.target, cause, len(seq.tokens))
        send = yield from self.replay_flow(seq, send, cause)
        if _key(seq.handle) != _key(old_handle):
            try:
                yield _Call(old_replica, "release_cache", (old_handle,), False)
            except ExecutorError as err:  # left to the server's idle timeout
                log.info("could not release the old copy of %s on %s: %s", old_handle.cache_id,
                         old_replica.target, err)
        return send
