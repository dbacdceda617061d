"""Replica sets through real servers: ``python -m ferrum_rpc.cli serve`` processes on
loopback, killed with SIGKILL, drained with SIGTERM and restarted under the same
address while a client holds sequences on them.

References come from a single-target client on one replica: every replica loads
the same checkpoint, so a sequence gives the same tokens wherever it runs, and a
failover must not change them.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from ferrum_rpc.client import AsyncExecutorClient, ExecutorClient, LogitsPolicy, connect, connect_async
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.replicas import AsyncReplicaSetClient, ReplicaPolicy, ReplicaSetClient, resolve_targets
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.client.speculative import NgramDrafter, speculative_generate
from ferrum_rpc.errors import ExecutorError, FailoverFailed, StaleHandle
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.types import ServerState
from tests.waiting import wait_for, wait_for_async

GREEDY = SamplingParams(greedy=True)
SEEDED = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
FAST = ReplicaPolicy(status_ttl_s=0.5, down_cooldown_s=0.3, seed=0)


class Replica(ServerProcess):
    """One ``ferrum-rpc serve`` process of the tiny model on a loopback port, restartable on
    that port (:class:`~ferrum_rpc.harness.ServerProcess` with these tests' flags)."""

    def __init__(self, model_dir, *extra: str):
        super().__init__(f"tiny={model_dir}", "--kv-tokens", "1024", "--block-size", "4", "--no-warmup",
                         "--threads", "1", "--grace", "10", *extra)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    with all_serving(*(Replica(tiny_llama_dir) for _ in range(3))) as replicas:
        yield replicas


@pytest.fixture
def healthy(cluster):
    """The cluster, every replica up; a test that kills one gets it back afterwards."""
    yield cluster
    for r in cluster:
        if not r.alive():
            r.restart()


@pytest.fixture(scope="module")
def reference(cluster):
    """Single-server generations (greedy and seeded sampling) for given prompts."""
    cache: dict = {}

    def generate(prompt: tuple[int, ...], n: int, params: SamplingParams = GREEDY) -> list[int]:
        key = (prompt, n, params)
        if key not in cache:
            with ExecutorClient(cluster[0].target, timeout=30) as one:
                cache[key] = list(generate_ids(one, list(prompt), n, params))
        return cache[key]
    return generate


def prompts(n: int, length: int = 9) -> list[tuple[int, ...]]:
    return [tuple((7 * i + 3 * j + 1) % 300 + 1 for j in range(length + i % 4)) for i in range(n)]


def free_blocks(targets: list[str]) -> dict[str, int]:
    out = {}
    for target in targets:
        with ExecutorClient(target, timeout=10) as one:
            out[target] = one.status().kv_blocks_free
    return out


# -- targets -------------------------------------------------------------------------------------


def test_target_forms_resolve_to_replicas():
    assert resolve_targets("ipv4:127.0.0.1:5001,127.0.0.1:5002") == ["127.0.0.1:5001", "127.0.0.1:5002"]
    assert resolve_targets("ipv6:[::1]:5001,[::1]:5002") == ["[::1]:5001", "[::1]:5002"]
    assert resolve_targets(["a:1", "b:2", "a:1"]) == ["a:1", "b:2"]
    assert resolve_targets("127.0.0.1:5001") == ["127.0.0.1:5001"]
    assert resolve_targets("dns:///localhost:5001") in (["dns:///localhost:5001"],
                                                        ["127.0.0.1:5001", "[::1]:5001"],
                                                        ["[::1]:5001", "127.0.0.1:5001"])
    assert type(connect(["127.0.0.1:1"])) is ExecutorClient  # one target: the plain client
    several = connect(["127.0.0.1:1", "127.0.0.1:2"])
    assert isinstance(several, ReplicaSetClient) and several.replicas == ["127.0.0.1:1", "127.0.0.1:2"]
    several.close()


def test_cli_takes_several_targets():
    from ferrum_rpc.cli import build_parser
    from ferrum_rpc.client.cli import targets_of

    parse = build_parser().parse_args
    assert targets_of(parse(["generate", "hi", "--target", "a:1", "--target", "b:2"])) == ["a:1", "b:2"]
    assert targets_of(parse(["generate", "hi", "--target", "a:1"])) == "a:1"
    assert targets_of(parse(["generate", "hi"])) == "127.0.0.1:50051"


# -- placement and affinity ---------------------------------------------------------------------------


def test_placement_spreads_and_calls_follow_the_handle(healthy, reference):
    targets = [r.target for r in healthy]
    instance = {r.target: r.instance for r in healthy}
    with connect(targets, timeout=30, replica_policy=FAST) as ex:
        outs = [ex.prefill(p, logits=LogitsPolicy.argmax()) for p in prompts(12)]
        owners = [ex.replica_of(o.kv_cache) for o in outs]
        assert set(owners) == set(targets), owners  # every replica took some
        assert max(owners.count(t) for t in targets) <= 6
        for out, owner in zip(outs, owners):
            assert out.kv_cache.server_instance_id == instance[owner]
            step = ex.decode(out.logits.argmax()[0], out.kv_cache, logits=LogitsPolicy.argmax())
            assert step.kv_cache.server_instance_id == instance[owner]  # affinity: the owner served it
            ex.release_cache(step.kv_cache)
        assert ex.live_sequences() == []


def test_prefix_locality_prefers_the_replica_holding_the_prefix(healthy):
    targets = [r.target for r in healthy]
    shared = list(range(1, 17))  # four 4-token blocks
    policy = ReplicaPolicy(prefix_tokens=16, locality_slack=2.0, seed=1)
    with connect(targets, timeout=30, replica_policy=policy) as ex:
        outs = [ex.prefill(shared + [100 + i, 200 + i], logits=LogitsPolicy.argmax()) for i in range(6)]
        owners = {ex.replica_of(o.kv_cache) for o in outs}
        assert len(owners) == 1, owners
        assert all(o.cached_tokens >= 16 for o in outs[1:])  # the owner's prefix cache served the prefix
        for o in outs:
            ex.release_cache(o.kv_cache)


def test_mixed_batch_across_owners_equals_decoding_each_alone(healthy):
    targets = "ipv4:" + ",".join(r.target for r in healthy)  # gRPC's multi-address form
    with connect(targets, timeout=30, replica_policy=FAST) as ex, \
            ExecutorClient(healthy[0].target, timeout=30) as one:
        assert isinstance(ex, ReplicaSetClient)
        ps = prompts(7)
        spread = [ex.prefill(p) for p in ps]
        alone = [one.prefill(p) for p in ps]
        assert len({ex.replica_of(o.kv_cache) for o in spread}) >= 2
        handles, solo = [o.kv_cache for o in spread], [o.kv_cache for o in alone]
        tokens = [o.logits.argmax()[0] for o in alone]
        with ex.decode_session() as session:
            for step in range(4):
                items = list(zip(tokens, handles))
                outs = ex.batch_decode(items) if step % 2 == 0 else session.step(items)
                singles = [one.decode(t, h) for t, h in zip(tokens, solo)]
                for got, want in zip(outs, singles):
                    np.testing.assert_allclose(got.logits.values, want.logits.values, rtol=1e-4, atol=1e-5)
                assert [o.kv_cache.sequence_length for o in outs] == [s.kv_cache.sequence_length for s in singles]
                handles, solo = [o.kv_cache for o in outs], [s.kv_cache for s in singles]
                tokens = [s.logits.argmax()[0] for s in singles]
        for h in handles:
            ex.release_cache(h)
        for h in solo:
            one.release_cache(h)


def test_async_client_routes_and_splits(healthy):
    targets = [r.target for r in healthy]

    async def run():
        async with connect_async(targets, timeout=30, replica_policy=FAST) as ex, \
                AsyncExecutorClient(targets[0], timeout=30) as one:
            assert isinstance(ex, AsyncReplicaSetClient)
            ps = prompts(6)
            outs = [await ex.prefill(p, logits=LogitsPolicy.argmax()) for p in ps]
            solo = [await one.prefill(p, logits=LogitsPolicy.argmax()) for p in ps]
            assert len({await ex.replica_of(o.kv_cache) for o in outs}) >= 2
            tokens = [o.logits.argmax()[0] for o in solo]
            got = await ex.batch_decode(list(zip(tokens, [o.kv_cache for o in outs])), LogitsPolicy.argmax())
            want = [await one.decode(t, o.kv_cache, LogitsPolicy.argmax()) for t, o in zip(tokens, solo)]
            assert [g.logits.argmax() for g in got] == [w.logits.argmax() for w in want]
            for g in got:
                await ex.release_cache(g.kv_cache)
            for w in want:
                await one.release_cache(w.kv_cache)
            assert ex.live_sequences() == []

    asyncio.run(run())


# -- failover -------------------------------------------------------------------------------------


def test_sigkill_mid_generation_replays_on_survivors(healthy, reference):
    """8 concurrent generations (6 greedy, 2 seeded sampling); when every one has produced 5
    tokens, the replica owning the most of them is SIGKILLed.  Every generation finishes
    with the single-server tokens, and the survivors get all their blocks back."""
    targets = [r.target for r in healthy]
    by_target = {r.target: r for r in healthy}
    ps = prompts(8)
    params = [SEEDED if i in (2, 5) else GREEDY for i in range(8)]
    want = [reference(p, 20, sp) for p, sp in zip(ps, params)]
    before = free_blocks(targets)
    ex = connect(targets, timeout=30, replica_policy=FAST)
    owners: dict[int, str] = {}
    victim: list[str] = []

    def kill_busiest():
        counts = {t: list(owners.values()).count(t) for t in targets}
        victim.append(max(counts, key=counts.get))
        by_target[victim[0]].kill()

    barrier = threading.Barrier(8, action=kill_busiest, timeout=60)

    def run(i: int) -> list[int]:
        got = []
        for token in generate_ids(ex, list(ps[i]), 20, params[i]):
            got.append(token)
            if len(got) == 5:
                owners[i] = next(s.replica for s in ex.live_sequences() if s.tokens[:len(ps[i])] == ps[i])
                barrier.wait()
        return got

    try:
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(run, range(8)))
        assert got == want
        moved = [i for i, t in owners.items() if t == victim[0]]
        assert moved, "the victim owned none of the sequences"
        assert ex.live_sequences() == []
    finally:
        ex.close()
    survivors = [t for t in targets if t != victim[0]]
    assert free_blocks(survivors) == {t: before[t] for t in survivors}


def test_speculative_generate_survives_its_owner_dying(healthy, reference):
    targets = [r.target for r in healthy]
    by_target = {r.target: r for r in healthy}
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    want = reference(tuple(prompt), 24)

    class KillingDrafter(NgramDrafter):
        rounds = 0

        def draft(self, context, k):
            self.rounds += 1
            if self.rounds == 3:
                (seq,) = ex.live_sequences()
                by_target[seq.replica].kill()
            return super().draft(context, k)

    with connect(targets, timeout=30, replica_policy=FAST) as ex:
        for server_side in (True, False):
            result = speculative_generate(ex, prompt, 24, k=3, drafter=KillingDrafter(), server_side=server_side)
            assert result.tokens == want
            assert ex.live_sequences() == []


def test_sigterm_drain_moves_new_and_in_flight_work(tiny_llama_dir, healthy, reference):
    """A replica holding a decode in flight (its worker waits 400 ms to batch) gets SIGTERM:
    that call finishes there; the sequence's next call moves by replay; new sequences go
    elsewhere at once; the drained server exits 0."""
    draining = Replica(tiny_llama_dir, "--batch-wait-ms", "400")
    try:
        draining.wait_serving()
        others = [r.target for r in healthy[:2]]
        prompt = prompts(1)[0]
        want = reference(prompt, 8)
        # placed by load alone: KV events would keep the prompt on the replica caching it
        with connect([draining.target, *others], timeout=30, replica_policy=replace(FAST, kv_events=False)) as ex:
            handle = None
            for _ in range(20):  # place until one lands on the slow replica
                o = ex.prefill(list(prompt), logits=LogitsPolicy.argmax())
                if ex.replica_of(o.kv_cache) == draining.target:
                    handle = o.kv_cache
                    break
                ex.release_cache(o.kv_cache)
            assert handle is not None, "no sequence was placed on the slow replica"
            tokens = [o.logits.argmax()[0]]
            with ThreadPoolExecutor(1) as pool:
                in_flight = pool.submit(ex.decode, tokens[-1], handle, LogitsPolicy.argmax())
                # A server process shows no count of admitted calls without ending the held batch
                # (GetStatus queues a job): the signal goes out 0.15 s into the 400 ms batch wait.
                time.sleep(0.15)  # unobservable: no server figure says the decode was admitted
                draining.proc.send_signal(signal.SIGTERM)
                step = in_flight.result(30)
            assert step.kv_cache.server_instance_id == draining.instance  # finished where it was
            tokens.append(step.logits.argmax()[0])
            fresh = [ex.prefill(p, logits=LogitsPolicy.argmax()) for p in prompts(4)]
            assert all(ex.replica_of(f.kv_cache) != draining.target for f in fresh)
            handle = step.kv_cache
            while len(tokens) < 8:
                step = ex.decode(tokens[-1], handle, logits=LogitsPolicy.argmax())
                handle = step.kv_cache
                tokens.append(step.logits.argmax()[0])
            assert ex.replica_of(handle) in others
            assert tokens == want
            for h in [handle] + [f.kv_cache for f in fresh]:
                ex.release_cache(h)
        assert draining.proc.wait(30) == 0
    finally:
        draining.kill()


def test_restart_under_same_address_replays_opt_out_raises_and_bounds_hold(healthy, reference):
    """Replica C and an address where nothing listens.  C is killed: an opt-out client's
    call raises UNAVAILABLE, a bounded client's raises FailoverFailed in time.  C comes
    back on its port (a new instance): the failover clients' next calls replay their
    sequences there instead of failing with STALE_HANDLE, sync and asyncio alike."""
    c = healthy[2]
    targets = [c.target, f"127.0.0.1:{free_port()}"]
    prompt = prompts(3)[2]
    want = reference(prompt, 10)
    bounded = ReplicaPolicy(max_attempts=2, failover_timeout_s=1.5, down_cooldown_s=0.2, seed=0)
    patient = ReplicaPolicy(max_attempts=100, failover_timeout_s=30, down_cooldown_s=0.2, seed=0)

    def start(ex):
        out = ex.prefill(list(prompt), logits=LogitsPolicy.argmax())
        return out.kv_cache, [out.logits.argmax()[0]]

    def steps(ex, handle, tokens, n):
        for _ in range(n):
            out = ex.decode(tokens[-1], handle, logits=LogitsPolicy.argmax())
            handle = out.kv_cache
            tokens.append(out.logits.argmax()[0])
        return handle

    async def async_part(handle_tokens):
        async with connect_async(targets, timeout=30, replica_policy=patient) as aex:
            out = await aex.prefill(list(prompt), logits=LogitsPolicy.argmax())
            handle_tokens.append((aex, out.kv_cache, [out.logits.argmax()[0]]))
            await resume.wait()
            _, handle, tokens = handle_tokens[0]
            while len(tokens) < 10:
                out = await aex.decode(tokens[-1], handle, logits=LogitsPolicy.argmax())
                handle, tokens = out.kv_cache, tokens + [out.logits.argmax()[0]]
            assert await aex.replica_of(handle) == c.target
            await aex.release_cache(handle)
            return tokens

    with connect(targets, timeout=10, replica_policy=patient) as ex, \
            connect(targets, timeout=10, failover=False, replica_policy=FAST) as opt_out, \
            connect(targets, timeout=10, replica_policy=bounded) as quick:
        h, toks = start(ex)
        h = steps(ex, h, toks, 3)
        h_out, toks_out = start(opt_out)
        h_quick, toks_quick = start(quick)
        loop = asyncio.new_event_loop()
        resume = asyncio.Event()
        async_state: list = []
        async_task = loop.create_task(async_part(async_state))
        loop.run_until_complete(wait_for_async(lambda: async_state, 30, "the asyncio client's prefill"))

        c.kill()
        with pytest.raises(ExecutorError) as caught:
            opt_out.decode(toks_out[-1], h_out)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE and not isinstance(caught.value, FailoverFailed)
        start_t = time.monotonic()
        with pytest.raises(FailoverFailed) as failed:
            quick.decode(toks_quick[-1], h_quick)
        assert time.monotonic() - start_t < 5
        assert failed.value.cause is not None and failed.value.cause.code == grpc.StatusCode.UNAVAILABLE

        c.restart()
        # opt-out: the restarted server does not know it.  The opt-out client's channel may
        # still be in its reconnect backoff from the dead time (UNAVAILABLE at once): wait it out.
        def refused_as_stale() -> bool:
            try:
                opt_out.decode(toks_out[-1], h_out)
            except StaleHandle:
                return True
            except ExecutorError as err:
                if err.code is not grpc.StatusCode.UNAVAILABLE:
                    raise
                return False
            pytest.fail("the restarted server accepted a handle of its earlier instance")

        wait_for(refused_as_stale, 10, "STALE_HANDLE from the restarted server (not UNAVAILABLE)")
        h = steps(ex, h, toks, 6)  # STALE_HANDLE from the new instance: replayed there
        assert toks == want
        assert h.server_instance_id == c.instance and ex.replica_of(h) == c.target
        ex.release_cache(h)
        resume.set()
        assert loop.run_until_complete(async_task) == want
        loop.close()
        status = ExecutorClient(c.target, timeout=10)
        try:
            assert status.status().state is ServerState.SERVING
            assert status.status().active_sequences == 0
        finally:
            status.close()


def test_batches_forks_and_truncations_survive_a_kill(healthy):
    """Forked children, a truncated sequence and plain ones spread over the replicas,
    stepped through a DecodeSession and BatchDecode in turn; before the second session
    step the parent's replica is SIGKILLed (its session stream dies with it); every step equals
    the same operations on one server (the forks' and the truncation's histories were
    replayed, the lost stream reopened on the new owner)."""
    targets = [r.target for r in healthy]
    by_target = {r.target: r for r in healthy}
    argmax = LogitsPolicy.argmax()
    with connect(targets, timeout=30, replica_policy=FAST) as ex, contextlib.ExitStack() as stack:

        def build(c):
            handles, tokens = [], []
            for p in prompts(4):
                out = c.prefill(list(p), logits=argmax)
                handles.append(out.kv_cache)
                tokens.append(out.logits.argmax()[0])
            for _ in range(3):  # the last sequence grows, then is cut back by two
                step = c.decode(tokens[3], handles[3], logits=argmax)
                handles[3], tokens[3] = step.kv_cache, step.logits.argmax()[0]
            handles[3] = c.truncate_kv(handles[3], handles[3].sequence_length - 2)
            kids = c.fork_cache(handles[0], 2)
            return handles + kids, tokens + [tokens[0], (tokens[0] + 1) % 300]

        handles, tokens = build(ex)
        # the reference server: a replica the kill below spares (placement follows load)
        spared = next(t for t in targets if t != ex.replica_of(handles[0]))
        one = stack.enter_context(ExecutorClient(spared, timeout=30))
        solo, solo_tokens = build(one)
        assert tokens == solo_tokens
        session = ex.decode_session()  # streams to every owner, the victim's included
        for step in range(5):
            if step == 2:  # a session step: the victim's stream is open and dies
                by_target[ex.replica_of(handles[0])].kill()  # the parent's and the children's replica
            items = list(zip(tokens, handles))
            got = session.step(items, logits=argmax) if step % 2 == 0 else ex.batch_decode(items, logits=argmax)
            want = [one.decode(t, h, logits=argmax) for t, h in zip(tokens, solo)]
            assert [g.logits.argmax() for g in got] == [w.logits.argmax() for w in want]
            assert [g.kv_cache.sequence_length for g in got] == [w.kv_cache.sequence_length for w in want]
            handles, solo = [g.kv_cache for g in got], [w.kv_cache for w in want]
            tokens = [w.logits.argmax()[0] for w in want]
        session.close()
        for h in handles:
            ex.release_cache(h)
        for h in solo:
            one.release_cache(h)
        assert ex.live_sequences() == []


def test_failed_split_batch_changes_nothing(healthy):
    """Opt-out client, a batch across owners, one owner dead: the call raises, and the part
    that ran on the live owners is undone (old handles decode as if nothing happened)."""
    targets = [r.target for r in healthy]
    by_target = {r.target: r for r in healthy}
    argmax = LogitsPolicy.argmax()
    with connect(targets, timeout=30, failover=False, replica_policy=FAST) as ex:
        outs = [ex.prefill(list(p), logits=argmax) for p in prompts(6)]
        owners = [ex.replica_of(o.kv_cache) for o in outs]
        assert len(set(owners)) >= 2
        victim = owners[0]
        live = [(o.logits.argmax()[0], o.kv_cache) for o, t in zip(outs, owners) if t != victim]
        expected = [ex.decode(t, h, logits=argmax) for t, h in live]  # what the next step gives
        for e, (_, h) in zip(expected, live):
            ex.truncate_kv(e.kv_cache, h.sequence_length)
        by_target[victim].kill()
        with pytest.raises(ExecutorError) as caught:
            ex.batch_decode([(o.logits.argmax()[0], o.kv_cache) for o in outs], logits=argmax)
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        again = [ex.decode(t, h, logits=argmax) for t, h in live]  # lengths as before the failed call
        assert [a.logits.argmax() for a in again] == [e.logits.argmax() for e in expected]
        for a in again:
            ex.release_cache(a.kv_cache)
