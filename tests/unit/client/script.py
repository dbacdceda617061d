"""A scripted driver for the replica set's flows (``ferrum_rpc.client.replicas``).

It stands in for the network: each action a flow yields is checked against the
next expected step, and answered with that step's canned outcome (a value, or an
ExecutorError the call raises).  An action the script did not expect, or steps
left over when the flow ends, fail the test (:class:`ScriptError`).  Time is a
fake clock that a ``_Sleep`` advances, so cooldowns and bounds are exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ferrum_rpc.client.fleet import _Replica
from ferrum_rpc.client.replicas.actions import _Call, _Done, _Lost, _Parallel, _Sleep, _resume
from ferrum_rpc.client.replicas.policy import ReplicaPolicy
from ferrum_rpc.client.replicas.routing import _Routing
from ferrum_rpc.types import (
    BlockTable,
    Capabilities,
    DecodeOutput,
    ExecutorStatus,
    KvCacheHandle,
    PrefillOutput,
    ServerState,
    VerifyOutput,
)


class ScriptError(AssertionError):
    """The flow did something the script did not expect."""


@dataclass
class Call:
    """One expected call: ``target``'s ``method`` (``args`` checked when given, or a
    predicate of them), answered with ``outcome``."""

    target: str
    method: str
    outcome: Any = None
    args: tuple | Callable[[tuple], bool] | None = None
    stream: bool = False

    def check(self, call: _Call) -> None:
        got = (call.replica.target, call.name, call.stream)
        if got != (self.target, self.method, self.stream):
            raise ScriptError(f"expected {self.target}.{self.method}{' (stream)' * self.stream}, "
                              f"the flow called {got[0]}.{got[1]}{' (stream)' * got[2]}{call.args}")
        if self.args is None:
            return
        ok = self.args(call.args) if callable(self.args) else call.args == self.args
        if not ok:
            raise ScriptError(f"{self.target}.{self.method}: expected args {self.args}, got {call.args}")


@dataclass
class Parallel:
    """Expected calls run together, matched whatever their order."""

    calls: list[Call]

    def __init__(self, *calls: Call):
        self.calls = list(calls)


@dataclass
class Sleep:
    """An expected wait (of ``seconds``, when given); it advances the clock."""

    seconds: float | None = None


@dataclass
class Lost:
    """An expected drop of the stream to ``target``."""

    target: str


@dataclass
class Clock:
    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Script:
    """Runs one flow against ``steps``; :meth:`run` returns what it returned (or raises
    what it raised), after checking that every step was taken."""

    steps: list[Any]
    clock: Clock = field(default_factory=Clock)
    taken: list[Any] = field(default_factory=list)

    def run(self, flow) -> Any:
        request = _resume(flow, None)
        while not isinstance(request, _Done):
            request = _resume(flow, self._answer(request))
        if self.steps:
            raise ScriptError(f"the flow ended with {len(self.steps)} step(s) not taken, first {self.steps[0]}")
        return request.value

    def _next(self, kind: type, request: Any) -> Any:
        if not self.steps:
            raise ScriptError(f"the flow asked for {request} after the script's last step")
        step = self.steps.pop(0)
        if not isinstance(step, kind):
            raise ScriptError(f"expected {step}, the flow asked for {request}")
        self.taken.append(step)
        return step

    def _answer(self, request: Any) -> Any:
        if isinstance(request, _Call):
            return _outcome(self._next(Call, request), request)
        if isinstance(request, _Parallel):
            step = self._next(Parallel, request)
            left, outcomes = list(step.calls), []
            for call in request.calls:
                match = next((c for c in left if c.target == call.replica.target and c.method == call.name), None)
                if match is None:
                    raise ScriptError(f"parallel calls: {call.replica.target}.{call.name} not expected ({step})")
                left.remove(match)
                outcomes.append(_outcome(match, call))  # an ExecutorError comes back as a value, as from a driver
            if left:
                raise ScriptError(f"parallel calls not made: {left}")
            return outcomes
        if isinstance(request, _Sleep):
            step = self._next(Sleep, request)
            if step.seconds is not None and abs(step.seconds - request.seconds) > 1e-9:
                raise ScriptError(f"expected a sleep of {step.seconds}s, the flow slept {request.seconds}s")
            self.clock.now += request.seconds
            return None
        if isinstance(request, _Lost):
            step = self._next(Lost, request)
            if step.target != request.replica.target:
                raise ScriptError(f"expected the stream to {step.target} dropped, not {request.replica.target}")
            return None
        raise ScriptError(f"unknown action {request!r}")


def _outcome(step: Call, call: _Call) -> Any:
    step.check(call)
    return step.outcome


# -- a replica set without clients, and canned results --------------------------------------


def routing(*targets: str, failover: bool = True, clock: Clock | None = None, **policy) -> _Routing:
    """A replica set's routing over ``targets`` (replicas that hold no client), seeded."""
    policy.setdefault("seed", 0)
    policy.setdefault("kv_events", False)
    return _Routing([_Replica(t, None) for t in targets or ("a", "b")], ReplicaPolicy(**policy), failover,
                    clock=clock or Clock())


def serving(rs: _Routing, *targets: str, queue: int = 0, free: int = 100) -> None:
    """Marks ``targets`` (default all) as asked just now: serving, instance id "<target>1",
    block size 4, ``queue`` calls queued and ``free`` of 100 KV blocks free."""
    for replica in rs._fleet.replicas:
        if not targets or replica.target in targets:
            replica.status, replica.status_at = status(replica.target + "1", queue, free), rs.clock()
            replica.instance_id, replica.block_size = replica.target + "1", 4


def status(instance: str, queue: int = 0, free: int = 100, state: ServerState = ServerState.SERVING) -> ExecutorStatus:
    return ExecutorStatus(state, instance, "m", 100, 100 - free, free, 0, queue, 0, 0, 1.0)


def capabilities(block_size: int = 4) -> Capabilities:
    return Capabilities("m", 8, 2048, block_size, 100, 100 * block_size, (), ("float32",), True, True, True, 1 << 20)


def handle(instance: str, cache_id: str, length: int) -> KvCacheHandle:
    return KvCacheHandle(cache_id, length, 2, 1, 8, "cpu", BlockTable(4), "m", instance)


def prefilled(instance: str, cache_id: str, length: int) -> PrefillOutput:
    return PrefillOutput(None, handle(instance, cache_id, length))


def decoded(instance: str, cache_id: str, length: int) -> DecodeOutput:
    return DecodeOutput(None, handle(instance, cache_id, length))


def verified(instance: str, cache_id: str, length: int) -> VerifyOutput:
    return VerifyOutput(None, handle(instance, cache_id, length))
