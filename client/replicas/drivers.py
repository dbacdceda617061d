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


class _Driver:
    """What both drivers share: which client (or stream) a call runs on."""

    def _callee(self, call: _Call) -> Callable:
        return call.bound(self._stream(call.replica) if call.stream else call.replica.client)

    def _stream(self, replica: _Replica) -> Any:
        """The DecodeSession stream to ``replica`` (only a replica-set session has them)."""
        raise TypeError("a call on a DecodeSession stream outside a replica-set session")

    def _lost(self, replica: _Replica) -> None:
        """Drops the stream to a replica that cannot hold its sequences any more (none here)."""


class _SyncDriver(_Driver):
    """Runs flows on the caller's thread; parallel calls on a small pool."""

    _fleet: _Fleet
    _pool: ThreadPoolExecutor

    def _drive(self, flow: Flow) -> Any:
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


class _AsyncDriver(_Driver):
    """Awaits flows on the event loop; parallel calls gathered."""

    async def _drive(self, flow: Flow) -> Any:
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
