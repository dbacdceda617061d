"""A DecodeSession over a replica set: one stream per owning replica, opened on first
use.  A step's routing, failover and undo are a flow (:meth:`~.batches.Batches.step_flow`);
the session is its driver, holding the streams its calls run on and dropping those
whose replica is lost."""

from __future__ import annotations

import logging
import threading
from typing import Any, Iterable

import grpc

from .contract import _driven
from .drivers import AsyncDriver, SyncDriver
from ..fleet import _Replica
from ..rpc import DecodeItem
from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.types import LogitsPolicy, TokenChoice

log = logging.getLogger(__name__)


class _ReplicaSessions:
    """A DecodeSession over a replica set: one stream per owning replica, opened on
    first use; a step is split by owner, run in parallel and merged in order."""

    def __init__(self, client):
        self._client = client
        self._fleet = client.routing._fleet
        self._sessions: dict[_Replica, Any] = {}
        self._lock = threading.Lock()

    def _stream(self, replica: _Replica):
        with self._lock:
            if replica not in self._sessions:
                self._sessions[replica] = replica.client.decode_session()
            return self._sessions[replica]

    def _step_flow(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                   token_choice: TokenChoice | None = None):
        """One step: split by owner, one stream step per replica in parallel, merged in order."""
        return (yield from self._client.routing.batches.step_flow(items, logits, token_choice))


class ReplicaDecodeSession(_ReplicaSessions):
    __doc__ = _ReplicaSessions.__doc__

    step = _driven(_ReplicaSessions._step_flow, "step", over=lambda session: session)(False)

    def __init__(self, client):
        super().__init__(client)
        self._driver = SyncDriver(self._fleet, client._pool, stream=self._stream, lost=self._lost)

    def _drive(self, flow):
        return self._driver.drive(flow)

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

    step = _driven(_ReplicaSessions._step_flow, "step", over=lambda session: session)(True)

    def __init__(self, client):
        super().__init__(client)
        self._driver = AsyncDriver(stream=self._stream, lost=self._lost)

    def _drive(self, flow):
        return self._driver.drive(flow)

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
