"""The blocking and asyncio clients cannot drift: each pair (single-target clients,
replica sets, their decode sessions) exposes the same public methods with the same
parameters (``inspect.signature``), the asyncio one as coroutines; and a replica set
offers every call of the single-target client.  No server needed.

Intended differences are listed below with their reasons; anything else fails.
"""

from __future__ import annotations

import asyncio
import inspect

import grpc
import pytest

from ferrum_rpc.client import AsyncExecutorClient, AsyncReplicaSetClient, ExecutorClient, ReplicaSetClient
from ferrum_rpc.client.session import AsyncDecodeSession, DecodeSession
from ferrum_rpc.client.replicas import AsyncReplicaDecodeSession, ReplicaDecodeSession
from ferrum_rpc.client.rpc import RPCS
from ferrum_rpc.errors import NotServing
from tests.system.test_replicas import free_port

PAIRS = [
    (ExecutorClient, AsyncExecutorClient),
    (ReplicaSetClient, AsyncReplicaSetClient),
    (DecodeSession, AsyncDecodeSession),
    (ReplicaDecodeSession, AsyncReplicaDecodeSession),
]

# The context-manager protocol: the same methods under their asyncio names.
ASYNC_NAMES = {"__enter__": "__aenter__", "__exit__": "__aexit__"}

# Public members of the asyncio classes that are not coroutines, and why.
NOT_AWAITED = {
    "decode_session": "returns the session object (its stream opens on first use): `async with c.decode_session()`",
    "live_sequences": "reads this client's own bookkeeping, no I/O",
    "replicas": "a property: the targets the set was built with",
    "cancel": "a session's cancel only asks gRPC to end the stream (grpc.aio's call.cancel is not awaited); "
              "usable from an except block or a finally",
}

# What only a replica set has (ExecutorClient has no counterpart), and why.
REPLICA_SET_ONLY = {
    "replica_of": "which replica owns a handle: one server has no choice to report",
    "replica_status": "every replica's status; ExecutorClient.status is the one server's",
    "live_sequences": "the histories kept for failover; a single-target client keeps none",
    "replicas": "the replica targets",
}


def public(cls: type) -> dict[str, object]:
    """The public members of ``cls`` (its own and inherited), with the context-manager
    methods and ``__init__``."""
    names = [n for n in dir(cls) if not n.startswith("_")]
    names += [n for n in (*ASYNC_NAMES, *ASYNC_NAMES.values(), "__init__") if hasattr(cls, n)]
    return {n: inspect.getattr_static(cls, n) for n in names if n != "__init__" or cls.__init__ is not object.__init__}


def parameters(member: object, annotations: bool = True) -> list[tuple] | str:
    """A member's parameters as comparable tuples (name, kind, default and, with
    ``annotations``, annotation); a property is just "property"."""
    if isinstance(member, property):
        return "property"
    function = member.__func__ if isinstance(member, (staticmethod, classmethod)) else member
    return [(p.name, p.kind, p.default, p.annotation if annotations else None)
            for p in inspect.signature(function).parameters.values()]


def drift(sync_cls: type, async_cls: type) -> list[str]:
    """How ``async_cls`` differs from ``sync_cls`` (empty: none)."""
    sync, aio = public(sync_cls), public(async_cls)
    problems = []
    for name, member in sync.items():
        other = ASYNC_NAMES.get(name, name)
        if other not in aio:
            problems.append(f"{async_cls.__name__} lacks {other} ({sync_cls.__name__}.{name})")
            continue
        if parameters(member) != parameters(aio[other]):
            problems.append(f"{other}: {sync_cls.__name__}{parameters(member)} != "
                            f"{async_cls.__name__}{parameters(aio[other])}")
        if inspect.iscoroutinefunction(member):
            problems.append(f"{sync_cls.__name__}.{name} is a coroutine")
        awaited = inspect.iscoroutinefunction(aio[other])
        if name != "__init__" and awaited == (name in NOT_AWAITED):
            problems.append(f"{async_cls.__name__}.{other} {'is' if awaited else 'is not'} a coroutine")
    expected = {ASYNC_NAMES.get(n, n) for n in sync}
    problems += [f"{async_cls.__name__}.{n} has no counterpart in {sync_cls.__name__}" for n in aio if n not in expected]
    return problems


@pytest.mark.parametrize("sync_cls, async_cls", PAIRS, ids=lambda cls: cls.__name__)
def test_sync_and_asyncio_expose_the_same_methods(sync_cls, async_cls):
    assert drift(sync_cls, async_cls) == []


@pytest.mark.parametrize("single, several", [(ExecutorClient, ReplicaSetClient),
                                             (AsyncExecutorClient, AsyncReplicaSetClient)],
                         ids=lambda cls: cls.__name__)
def test_a_replica_set_offers_every_call_of_the_single_client(single, several):
    """Same names, kinds and defaults (annotations aside: the single-target client does
    not import the replica set's ReplicaPolicy to annotate ``replica_policy``, which it ignores)."""
    ours, theirs = public(single), public(several)
    for name, member in ours.items():
        assert name in theirs, f"{several.__name__} lacks {name}"
        assert parameters(theirs[name], annotations=False) == parameters(member, annotations=False), name
    assert sorted(set(theirs) - set(ours)) == sorted(REPLICA_SET_ONLY)


def test_every_rpc_is_a_method_of_every_client():
    for cls in (ExecutorClient, AsyncExecutorClient, ReplicaSetClient, AsyncReplicaSetClient):
        missing = [rpc.name for rpc in RPCS if not callable(getattr(cls, rpc.name, None))]
        assert missing == [], f"{cls.__name__} lacks {missing}"


def test_the_check_sees_a_drift():
    """The comparison itself: a missing method, a changed parameter and a method that
    is not a coroutine are each reported."""
    class Sync:
        def a(self, x: int = 1): ...
        def b(self): ...
        def c(self): ...

    class Async:
        async def a(self, x: int = 2): ...
        def c(self): ...

    problems = drift(Sync, Async)
    assert any(p.startswith("a:") for p in problems)
    assert any("lacks b" in p for p in problems)
    assert any("Async.c is not a coroutine" in p for p in problems)


def test_wait_ready_times_out_alike():
    """Nothing listens on the port: both clients raise NotServing (a grpc.FutureTimeoutError)
    naming the target, the model and what they saw."""
    target = f"127.0.0.1:{free_port()}"
    said = rf"{target} did not serve model 'm' within 0.2 s \(last seen: no connection\)"
    with ExecutorClient(target, model="m") as ex, pytest.raises(NotServing, match=said) as raised:
        ex.wait_ready(0.2)
    assert isinstance(raised.value, grpc.FutureTimeoutError)

    async def run():
        async with AsyncExecutorClient(target, model="m") as aex:
            with pytest.raises(NotServing, match=said):
                await aex.wait_ready(0.2)

    asyncio.run(run())
