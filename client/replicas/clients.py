"""The replica-set clients: :class:`ReplicaSetClient` (blocking) and
:class:`AsyncReplicaSetClient` (asyncio), and :func:`connect` / :func:`connect_async`,
which build a single-target client for one server and a replica set for several.

A replica set holds one single-target client per replica, its routing
(:class:`~.routing._Routing`, whose parts' flows route over the replicas) and a
driver (:mod:`.drivers`) that performs what the flows yield; its public calls are
:data:`~.contract.DRIVEN`, each a flow over the routing run by the driver.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from .contract import DRIVEN
from .drivers import AsyncDriver, SyncDriver
from .policy import ReplicaPolicy
from .routing import _Routing
from .sessions import AsyncReplicaDecodeSession, ReplicaDecodeSession
from ..client import (
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
from ..fleet import TrackedSequence, _Replica
from ..kv_router import KvRouter
from ..rpc import with_methods

# A replica that went away should be retried soon when it comes back (gRPC's default
# reconnect backoff grows to two minutes).
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]


class _ReplicaSet:
    """What the blocking and asyncio replica sets share: construction (the replicas'
    clients, the routing, the KV-event router) and the calls that are not flows."""

    _client_class: type  # the single-target client of each replica
    _session_class: type  # what decode_session opens

    def __init__(self, target: str | Sequence[str], *, model: str = "", timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: ClientTls | None = None,
                 token: str | None = None, failover: bool = True, replica_policy: ReplicaPolicy | None = None,
                 channel_options: Sequence[tuple[str, object]] = (),
                 keepalive: Keepalive | None = DEFAULT_KEEPALIVE):
        """One single-target client per replica (channels that reconnect within a second);
        the other arguments are :class:`~ferrum_rpc.client.client.ExecutorClient`'s."""
        self.model, self.timeout = model, timeout
        options = list(channel_options) + RECONNECT_OPTIONS
        self.routing = routing = _Routing([_Replica(t, self._client_class(
            t, model=model, timeout=timeout, max_message_bytes=max_message_bytes, tls=tls, token=token,
            channel_options=options, keepalive=keepalive)) for t in resolve_targets(target)],
            replica_policy, failover)
        self._fleet = routing._fleet
        routing._router = KvRouter(
            [r.target for r in self._fleet.replicas],
            lambda t: _channel(t, _options(max_message_bytes, keepalive) + options, tls, token, aio=False),
            model) if routing.policy.kv_events else None
        self._opened()

    def _close_router(self) -> None:
        if self.routing._router is not None:
            self.routing._router.close()

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


@with_methods(DRIVEN, aio=False)
class ReplicaSetClient(_ReplicaSet):
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
        self._driver = SyncDriver(self._fleet, self._pool)

    def _drive(self, flow):
        return self._driver.drive(flow)

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
class AsyncReplicaSetClient(_ReplicaSet):
    """:class:`ReplicaSetClient` for asyncio, over AsyncExecutorClients: the same methods, awaitable."""

    _client_class = AsyncExecutorClient
    _session_class = AsyncReplicaDecodeSession

    def _opened(self) -> None:
        self._driver = AsyncDriver()

    def _drive(self, flow):
        return self._driver.drive(flow)

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
