"""Releases over a replica set: a handle on its owner, a bare cache id on whichever
replica has it, a caller's request_id on every replica (names are per server)."""

from __future__ import annotations

import logging

from .actions import Flow, _Call
from .policy import moves_sequence
from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.types import KvCacheHandle

log = logging.getLogger(__name__)


class Releases:
    """Release flows (part of :class:`~.routing._Routing`)."""

    def __init__(self, routing):
        self.r = routing  # the state the flows read and change

    def release_name_flow(self, name: str) -> Flow:
        """Releases a request_id on every replica (names are per server, and a call whose
        reply was lost may have run on any replica it was tried on); the blocks freed."""
        freed = 0
        for replica in self.r._fleet.replicas:
            try:
                freed += yield _Call(replica, "release_cache", (None, name))
            except ExecutorError as err:
                if not moves_sequence(err):
                    raise
        return freed

    def release_flow(self, cache: KvCacheHandle | str) -> Flow:
        """Releases a sequence and stops tracking it; the blocks freed (0 when its replica
        is gone, restarted or stopping: the blocks went with it)."""
        if isinstance(cache, KvCacheHandle):
            seq, _ = self.r._fleet.resolve(cache)
            if seq is None:
                owner = yield from self.r.placement.owner_flow(cache)
                return (yield _Call(owner, "release_cache", (cache,)))
        else:
            seq = self.r._fleet.by_cache_id(cache)
            if seq is None:  # an id this client never saw: ask each replica
                last = None
                for replica in self.r._fleet.replicas:
                    try:
                        return (yield _Call(replica, "release_cache", (cache,)))
                    except ExecutorError as err:
                        last = err
                raise last
        try:
            freed = yield _Call(seq.replica, "release_cache", (seq.handle,))
        except ExecutorError as err:
            if not moves_sequence(err):
                raise
            # Its server is gone, restarted or stopping: the blocks go with it.
            log.info("released %s with its replica %s gone (%s)", seq.handle.cache_id, seq.replica.target, err)
            freed = 0
        self.r._fleet.forget(seq)
        return freed
