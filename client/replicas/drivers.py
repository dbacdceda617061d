"""The drivers: they perform what a flow yields (:mod:`.actions`) and nothing else.

The blocking driver runs a flow on the caller's thread (parallel calls on a small
pool), the asyncio driver awaits it on the event loop (parallel calls gathered).
Each counts a replica's calls in flight, which placement reads as load.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .actions import Flow, _Call, _Done, _Lost, _Parallel, _resume
from ..fleet import _Fleet, _Replica
from ferrum_rpc.errors import ExecutorError


def _no_stream(replica: _Replica) -> Any:
    raise TypeError("a call on a DecodeSession stream outside a replica-set session")


class _Driver:
    """What both drivers share: which client (or stream) a call runs on.

    Args:
        stream: the DecodeSession stream to a replica (only a replica-set session has them).
        lost: drops the stream to a replica that cannot hold its sequences any more.
    """

    def __init__(self, stream: Callable[[_Replica], Any] = _no_stream,
                 lost: Callable[[_Replica], None] = lambda replica: None):
        self._stream, self._lost = stream, lost

    def _callee(self, call: _Call) -> Callable:
        return call.bound(self._stream(call.replica) if call.stream else call.replica.client)


class SyncDriver(_Driver):
    """Runs flows on the caller's thread; parallel calls on ``pool``; counts a
    replica's calls in flight under ``fleet``'s lock."""

    def __init__(self, fleet: _Fleet, pool: ThreadPoolExecutor, **streams):
        super().__init__(**streams)
        self._fleet, self._pool = fleet, pool

    def drive(self, flow: Flow) -> Any:
        request = _resume(flow, None)
        while not isinstance(request, _Done):
            outcome = None
            if isinstance(request, _Call):
                outcome = self._outcome(request)
            elif isinstance(request, _Parallel):
                calls = request.calls
                outcome = [self._outcome(calls[0])] if len(calls) == 1 else list(self._pool.map(self._outcome, calls))
            elif isinstance(request, _Lost):
                self._lost(request.replica)
            else:
                time.sleep(request.seconds)
            request = _resume(flow, outcome)
        return request.value

    def _run(self, call: _Call) -> Any:
        if call.counted:
            with self._fleet.lock:
                call.replica.inflight += 1
        try:
            return self._callee(call)(*call.args)
        finally:
            if call.counted:
                with self._fleet.lock:
                    call.replica.inflight -= 1

    def _outcome(self, call: _Call) -> Any:
        try:
            return self._run(call)
        except ExecutorError as err:
            return err


class AsyncDriver(_Driver):
    """Awaits flows on the event loop; parallel calls gathered."""

    async def drive(self, flow: Flow) -> Any:
        request = _resume(flow, None)
        while not isinstance(request, _Done):
            outcome = None
            if isinstance(request, _Call):
                outcome = await self._outcome(request)
            elif isinstance(request, _Parallel):
                outcome = list(await asyncio.gather(*(self._outcome(c) for c in request.calls)))
            elif isinstance(request, _Lost):
                self._lost(request.replica)
            else:
                await asyncio.sleep(request.seconds)
            request = _resume(flow, outcome)
        return request.value

    async def _run(self, call: _Call) -> Any:
        if call.counted:
            call.replica.inflight += 1
        try:
            value = self._callee(call)(*call.args)
            return await value if inspect.isawaitable(value) else value
        finally:
            if call.counted:
                call.replica.inflight -= 1

    async def _outcome(self, call: _Call) -> Any:
        try:
            return await self._run(call)
        except ExecutorError as err:
            return err
