"""The drivers perform a flow's actions and nothing else: a method named by a call runs
on the replica's client (or, in a session, its stream), a function gets the client
first, parallel failures come back as values, in-flight calls are counted, and a lost
stream is dropped.  The clients here are plain in-process objects."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc

from ferrum_rpc.client.fleet import _Fleet, _Replica
from ferrum_rpc.client.replicas.actions import _Call, _Lost, _Parallel, _Sleep
from ferrum_rpc.client.replicas.drivers import AsyncDriver, SyncDriver
from ferrum_rpc.client.replicas.policy import ReplicaPolicy
from ferrum_rpc.errors import ExecutorError


class Server:
    """A replica's client stand-in: answers ``echo``, fails ``fail``, and notes what ran."""

    def __init__(self, name: str):
        self.name, self.ran, self.inflight_seen = name, [], []

    def echo(self, value, replica=None):
        self.ran.append(("echo", value))
        if replica is not None:
            self.inflight_seen.append(replica.inflight)
        return f"{self.name}:{value}"

    def fail(self):
        raise ExecutorError("down", code=grpc.StatusCode.UNAVAILABLE)


def joined(client, *parts):
    return client.name + "+" + "+".join(parts)


def flow(a, b):
    first = yield _Call(a, "echo", (1, a))
    both = yield _Parallel([_Call(b, "echo", (2,)), _Call(b, "fail", (), False)])
    made = yield _Call(a, joined, ("x", "y"))
    yield _Sleep(0.0)
    try:
        yield _Call(a, "fail")
    except ExecutorError as err:
        caught = err.code
    streamed = yield _Call(b, "echo", (3,), stream=True)
    yield _Lost(b)
    return first, both, made, caught, streamed


class Streams:
    """A session's streams, as a replica-set session gives its driver."""

    def __init__(self):
        self.streams, self.lost = {}, []

    def stream(self, replica):
        return self.streams.setdefault(replica, Server(replica.target + "-stream"))

    def drop(self, replica):
        self.lost.append(replica.target)


def check(out, a, b, lost):
    first, both, made, caught, streamed = out
    assert first == "a:1" and a.client.inflight_seen == [1] and a.inflight == 0  # counted while it ran
    assert both[0] == "b:2" and isinstance(both[1], ExecutorError)
    assert made == "a+x+y" and caught is grpc.StatusCode.UNAVAILABLE
    assert streamed == "b-stream:3" and b.client.ran == [("echo", 2)]  # the stream call went to the stream
    assert lost == ["b"]


def test_the_blocking_driver_runs_each_action_where_it_names():
    a, b = _Replica("a", Server("a")), _Replica("b", Server("b"))
    with ThreadPoolExecutor(2) as pool:
        session = Streams()
        driver = SyncDriver(_Fleet([a, b], ReplicaPolicy()), pool, stream=session.stream, lost=session.drop)
        check(driver.drive(flow(a, b)), a, b, session.lost)


def test_the_asyncio_driver_runs_each_action_where_it_names():
    a, b = _Replica("a", Server("a")), _Replica("b", Server("b"))
    session = Streams()
    driver = AsyncDriver(stream=session.stream, lost=session.drop)
    check(asyncio.run(driver.drive(flow(a, b))), a, b, session.lost)
