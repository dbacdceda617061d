"""The routing state a replica set's flows read and change: the replicas and live
sequences (:class:`~ferrum_rpc.client.fleet._Fleet`), the policy, the replica roles,
the KV-event router and the clock.  It performs no I/O itself: its flows yield the
calls they need, and the clients (:mod:`.clients`) drive them."""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from .batches import Batches
from .failover import Failover
from .placement import Placement
from .policy import ReplicaPolicy
from .releases import Releases
from ..disagg import Roles
from ..fleet import _Fleet, _Replica


class _Routing:
    """One fleet of replicas and the parts whose flows route over it: ``placement``,
    ``failovers`` (affinity and the moves that keep a sequence alive), ``batches`` and
    ``releases``.  Shared by the blocking and asyncio replica sets (and built bare,
    with replicas that hold no client, by the flows' unit tests)."""

    def __init__(self, replicas: Sequence[_Replica], policy: ReplicaPolicy | None = None, failover: bool = True,
                 router: Any = None, clock: Callable[[], float] = time.monotonic):
        """``router``: a :class:`~ferrum_rpc.client.kv_router.KvRouter` over the replicas
        (None: placement by the first-tokens LRU alone); ``clock``: monotonic seconds, for
        cooldowns, status ages and failover bounds."""
        self.failover, self.clock = failover, clock
        self.policy = policy or ReplicaPolicy()
        self._fleet = _Fleet(list(replicas), self.policy)
        self._roles = Roles(self._fleet.replicas, self.policy.roles)
        self._router = router
        self.placement = Placement(self)
        self.failovers = Failover(self)
        self.batches = Batches(self)
        self.releases = Releases(self)
