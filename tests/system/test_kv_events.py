"""KV events for routers: WatchKvEvents against the server's own prefix cache,
tenant scope, snapshots, resyncs, draining, and the replica set's placement by events.

Real server processes on loopback, the tiny model, KV blocks of 4 tokens.  The oracle
for "the events tell the truth" is the server's prefix cache itself: a prompt's
``cached_tokens`` on a new prefill must be what the events said the server holds.
"""

from __future__ import annotations

import asyncio
import signal
import time

import grpc
import pytest

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.client.kv_router import Gap, PrefixIndex, chain
from ferrum_rpc.client.replicas import ReplicaPolicy, ReplicaSetClient
from ferrum_rpc.harness import all_serving
from ferrum_rpc.server.kv.events import KvEventHub, Stored, Subscriber
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.system.test_replicas import Replica
from tests.waiting import wait_for

ALICE, BOB = "alice-token-aaaaaaaaaaaaaaaaaaaa", "bob-token-bbbbbbbbbbbbbbbbbbbbbbb"
BS = 4  # Replica's --block-size


def _md(token: str | None):
    return [("authorization", f"Bearer {token}")] if token else None


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 31 + 7 * j) % 250 + 1 for j in range(n)]


@pytest.fixture(scope="module")
def tenants_server(tiny_llama_dir, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("tokens") / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    # 256 tokens of KV = 64 blocks: a few prompts evict the oldest cached blocks
    with all_serving(Replica(tiny_llama_dir, "--auth-tokens", str(tokens), "--kv-tokens", "256")) as (server,):
        yield server


class Watch:
    """A raw WatchKvEvents stream (as a grpcurl or Go router would read it) and an index of it."""

    def __init__(self, target: str, token: str | None, snapshot: bool = True, timeout: float = 60):
        self.channel = grpc.insecure_channel(target)
        self.call = pb_grpc.ModelExecutorStub(self.channel).WatchKvEvents(
            pb.WatchKvEventsRequest(snapshot=snapshot), metadata=_md(token), timeout=timeout)
        self.hello = next(self.call).hello
        self.index = PrefixIndex()
        self.index.start(self.hello)
        self.events: list[pb.KvEvent] = []

    def read_until(self, done, timeout: float = 20) -> None:
        end = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < end, f"events so far: {self.events}"
            batch = next(self.call)
            self.events.extend(batch.events)
            self.index.apply(batch.events)

    def close(self) -> None:
        self.call.cancel()
        self.channel.close()


def _prefill(stub, token, tokens, **kw) -> pb.PrefillResponse:
    return stub.Prefill(pb.PrefillRequest(token_ids=tokens, **kw), metadata=_md(token), timeout=60)


def _release(stub, token, handle) -> None:
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=handle.cache_id), metadata=_md(token), timeout=60)


def test_events_tell_what_the_prefix_cache_holds(tenants_server):
    """Stored events name each full block by its chained hash (computed here from the
    token ids alone), numbered without gaps; eviction removes them; and what the index
    built from the events says a server holds is what a new prefill finds cached."""
    with grpc.insecure_channel(tenants_server.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        watch = Watch(tenants_server.target, ALICE)
        try:
            assert watch.hello.block_size == BS and len(watch.hello.chain_root) == 16
            first = watch.hello.next_sequence
            prompt = _prompt(1, 10)  # 2 full blocks
            out = _prefill(stub, ALICE, prompt)
            want = chain(watch.hello.chain_root, BS, prompt)
            watch.read_until(lambda: len(watch.events) >= 2)
            stored = [e.stored for e in watch.events]
            assert [e.sequence for e in watch.events] == [first, first + 1]
            assert [s.block_hash for s in stored] == want
            assert [s.parent_hash for s in stored] == [watch.hello.chain_root, want[0]]
            assert [list(s.token_ids) for s in stored] == [prompt[:4], prompt[4:8]]
            _release(stub, ALICE, out.kv_cache)  # released blocks stay cached: no event
            assert watch.index.matched_tokens(prompt) == 8

            # 3 prompts of 100 tokens need 75 blocks of 64: the oldest cached ones go
            for seed in (2, 3, 4):
                handle = _prefill(stub, ALICE, _prompt(seed, 100)).kv_cache
                _release(stub, ALICE, handle)
            watch.read_until(lambda: watch.index.matched_tokens(prompt) == 0)
            removed = {e.removed for e in watch.events if e.WhichOneof("kind") == "removed"}
            assert set(want) <= removed
            numbers = [e.sequence for e in watch.events]
            assert numbers == list(range(first, first + len(numbers)))  # no gap, in order

            # the oracle: the server's own cache agrees with a snapshot, and the index the
            # events built, once caught up to it, is the snapshot, block for block
            for seed, n in ((1, 10), (3, 100), (4, 100), (2, 100)):
                tokens = _prompt(seed, n)
                snap = Watch(tenants_server.target, ALICE)
                watch.read_until(lambda: watch.index.next >= snap.hello.next_sequence)
                assert watch.index.hashes == {b.block_hash for b in snap.hello.cached}
                expected = min(snap.index.matched_tokens(tokens), (n - 1) // BS * BS)
                snap.close()
                got = _prefill(stub, ALICE, tokens)
                assert got.cached_tokens == expected, (seed, got.cached_tokens, expected)
                _release(stub, ALICE, got.kv_cache)
        finally:
            watch.close()


def test_a_tenant_sees_only_its_own_blocks_and_snapshots_start_complete(tenants_server):
    with grpc.insecure_channel(tenants_server.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        prompt = _prompt(9, 13)
        alice_first = _prefill(stub, ALICE, prompt)
        alice = Watch(tenants_server.target, ALICE)  # after the prefill: the snapshot has it
        bob = Watch(tenants_server.target, BOB, timeout=3)
        try:
            assert alice.hello.chain_root != bob.hello.chain_root
            assert alice.index.matched_tokens(prompt) == 12
            assert {b.block_hash for b in alice.hello.cached} >= set(chain(alice.hello.chain_root, BS, prompt))
            assert bob.index.matched_tokens(prompt) == 0 and not bob.hello.cached
            other = _prompt(10, 9)
            _prefill(stub, ALICE, other)
            alice.read_until(lambda: alice.index.matched_tokens(other) == 8)
            with pytest.raises(grpc.RpcError) as err:  # bob's stream stays silent until its deadline
                bob.read_until(lambda: False, timeout=10)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and bob.events == []
            # bob's own prompt: his own events, his own chain (the same tokens hash otherwise)
            bob = Watch(tenants_server.target, BOB)
            got = _prefill(stub, BOB, prompt)
            assert got.cached_tokens == 0  # no sharing across tenants
            bob.read_until(lambda: bob.index.matched_tokens(prompt) == 12)
            assert not set(chain(bob.hello.chain_root, BS, prompt)) & set(chain(alice.hello.chain_root, BS, prompt))
            plain = Watch(tenants_server.target, ALICE, snapshot=False)
            assert not plain.hello.cached and plain.index.matched_tokens(prompt) == 0
            plain.close()
        finally:
            alice.close()
            bob.close()
        _release(stub, ALICE, alice_first.kv_cache)


def test_a_subscriber_that_falls_behind_is_resynced_and_a_gap_restarts_an_index():
    """The hub in process (real threads): past its queue limit a subscriber collects
    nothing and must be resynced from a snapshot; a router's index refuses a gap."""
    loop = asyncio.new_event_loop()
    try:
        hub = KvEventHub(BS, queue_limit=3)
        sub = Subscriber("alice", loop)
        assert hub.subscribe(sub, lambda: []) == (1, [])
        blocks = [Stored(bytes([i]) * 16, bytes(16), (i,) * BS) for i in range(5)]
        for block in blocks:
            hub.publish("alice", block)
        hub.publish("bob", blocks[0])  # nobody watches bob: not numbered, not kept
        events, behind, closed = hub.take(sub)
        assert behind and events == [] and not closed
        assert hub.subscribe(sub, lambda: blocks) == (6, blocks)  # numbers go on after the snapshot
        hub.publish("alice", blocks[0])
        assert hub.take(sub) == ([(6, blocks[0])], False, False)
        hub.unsubscribe(sub)
        assert not hub.active
    finally:
        loop.close()

    index = PrefixIndex()
    index.start(pb.KvEventsHello(chain_root=bytes(16), block_size=BS, next_sequence=4))
    index.apply([pb.KvEvent(sequence=4, stored=pb.KvBlock(block_hash=b"a" * 16))])
    with pytest.raises(Gap):
        index.apply([pb.KvEvent(sequence=6, removed=b"a" * 16)])
    assert index.matched_tokens([1, 2, 3, 4]) is None  # not consulted until it restarts


def test_draining_ends_the_streams_at_once(tiny_llama_dir):
    with all_serving(Replica(tiny_llama_dir, "--grace", "30")) as (server,):
        watch = Watch(server.target, None)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        try:
            for _ in watch.call:
                pass
        except grpc.RpcError as err:
            assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED), err
        assert time.monotonic() - start < 5  # not the 30 s grace, nor the 1 s stop
        watch.close()


def test_placement_by_events_hits_prefixes_the_lru_cannot_know(tiny_llama_dir):
    """Another caller put 4 system prompts of 24 tokens (shorter than the LRU's 32-token
    window) on replica X.  A fresh replica set placing by KV events sends each follow-up
    to X and hits 24 cached tokens every time; with the LRU (kv_events off) it places by
    load, on the emptier replica, and misses every one."""
    with all_serving(Replica(tiny_llama_dir), Replica(tiny_llama_dir)) as (x, y):
        systems = [_prompt(20 + i, 24) for i in range(4)]
        with ExecutorClient(x.target, timeout=30) as direct:
            kept = [direct.prefill(s + [5, 6, 7]).kv_cache for s in systems]  # X holds more: more load
        policy = dict(status_ttl_s=0.05, seed=0)
        with ReplicaSetClient([x.target, y.target], timeout=30,
                              replica_policy=ReplicaPolicy(**policy)) as by_events:
            wait_for(lambda: [by_events.routing._router.matched_tokens(s).get(x.target, 0) for s in systems], 20,
                     "the events (24 tokens matched on X per system prompt)", until=lambda m: min(m) >= 24)
            hits = [by_events.prefill(s + [9, 10, 11, i]).cached_tokens for i, s in enumerate(systems)]
        with ReplicaSetClient([x.target, y.target], timeout=30,
                              replica_policy=ReplicaPolicy(kv_events=False, **policy)) as by_lru:
            lru_hits = [by_lru.prefill(s + [12, 13, 14, i]).cached_tokens for i, s in enumerate(systems)]
        print(f"cached tokens per follow-up: by KV events {hits}, by the first-tokens LRU {lru_hits}")
        assert hits == [24] * 4
        assert lru_hits == [0] * 4
        with ExecutorClient(x.target, timeout=30) as direct:
            for handle in kept:
                direct.release_cache(handle)
