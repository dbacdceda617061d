"""What a replica set's flows yield, and how a driver resumes them.

A flow is a generator that decides (placement, failover, replay, batch undo) and
performs no I/O: it yields the action it needs next and is resumed with the
outcome, a call's value, or its :class:`~ferrum_rpc.errors.ExecutorError` thrown
in.  A driver (:mod:`.drivers`, or a scripted one in the unit tests) performs the
actions and nothing else.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generator

from ferrum_rpc.errors import ExecutorError

if TYPE_CHECKING:
    from ..fleet import _Replica

Flow = Generator[Any, Any, Any]


@dataclass
class _Call:
    """One call on a replica: its client's method named ``method`` with ``args`` (a
    value, or an awaitable in asyncio).  ``method`` may instead be a function, called
    with the client first (a call made of several RPCs: a decode-ahead run)."""

    replica: _Replica
    method: str | Callable
    args: tuple = ()
    counted: bool = True  # counts toward the replica's in-flight load
    stream: bool = False  # a method of the replica's DecodeSession stream, not of its client

    @property
    def name(self) -> str:
        return self.method if isinstance(self.method, str) else self.method.__name__

    def bound(self, owner: Any) -> Callable:
        """What the driver calls with ``args``, given the client (or stream) it runs on."""
        return getattr(owner, self.method) if isinstance(self.method, str) else functools.partial(self.method, owner)


@dataclass
class _Parallel:
    """Calls run together; the flow gets back a list of values or ExecutorErrors."""

    calls: list[_Call]


@dataclass
class _Sleep:
    seconds: float


@dataclass
class _Lost:
    """The DecodeSession stream to ``replica`` cannot be used any more: the driver drops it."""

    replica: _Replica


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
