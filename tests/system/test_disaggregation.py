"""Disaggregated placement through real server processes on loopback.

Two replicas marked for prefill, one for decode: prompts run only on the prefill
replicas (their prefill counters move, the decode replica's does not), every
decode step runs on the decode replica, and the tokens (and float32 logits,
bit for bit) equal a run on one ordinary server.  Then the failures: the
decode replica refuses the push, a prefill replica dies, every prefill
replica dies, the decode replica dies before or after the move; no sequence
is lost and no token changes.
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np
import pytest

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.replicas import AsyncReplicaSetClient, ReplicaPolicy, ReplicaSetClient
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.types import TokenChoice

FLAGS = ("--block-size", "4", "--no-warmup", "--threads", "1", "--grace", "5")
DECODE_POOL = 128  # tokens: the decode replica refuses a push of a longer sequence
GREEDY = SamplingParams(greedy=True)


@pytest.fixture(scope="module")
def cluster(tiny_llama_dir):
    """Prefill replicas p1 and p2, decode replica d (a small pool), and r, an ordinary
    server for the references."""
    servers = [ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--kv-tokens", "1024") for _ in range(3)]
    servers.append(ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--kv-tokens", str(DECODE_POOL)))
    with all_serving(*servers) as (p1, p2, r, d):
        yield {"p1": p1, "p2": p2, "d": d, "r": r}


@pytest.fixture
def healthy(cluster):
    """The cluster, every server up (restarted before a test, not after: the last test
    that kills one leaves it to the module's teardown)."""
    for server in cluster.values():
        if not server.alive():
            server.restart()
    return cluster


def policy(cluster) -> ReplicaPolicy:
    return ReplicaPolicy(status_ttl_s=0.2, down_cooldown_s=0.3, seed=0, roles={
        cluster["p1"].target: "prefill", cluster["p2"].target: "prefill", cluster["d"].target: "decode"})


def replica_set(cluster, cls=ReplicaSetClient):
    return cls([cluster[n].target for n in ("p1", "p2", "d")], timeout=30, replica_policy=policy(cluster))


def prompt(n: int, seed: int = 0) -> list[int]:
    return [(37 * i + 11 + 101 * seed) % 320 for i in range(n)]


def counters(cluster, *names) -> dict[str, tuple[int, int]]:
    """(prefills, decodes) each named server has run; alive ones only."""
    out = {}
    for name in names:
        if cluster[name].alive():
            with ExecutorClient(cluster[name].target, timeout=30) as c:
                s = c.status()
                out[name] = (s.prefill_operations, s.decode_operations)
    return out


def greedy(client, tokens: list[int], n: int):
    """A prompt and n greedy steps with full float32 logits: the tokens, each row's bits,
    the last handle (not released)."""
    out = client.prefill(tokens)
    chosen, rows = [], []
    for _ in range(n):
        token = int(out.logits.argmax()[0])
        chosen.append(token)
        out = client.decode(token, out.kv_cache)
        rows.append(np.asarray(out.logits.values, dtype=np.float32).view(np.uint32))
    return chosen, rows, out.kv_cache


def reference(cluster, tokens: list[int], n: int):
    with ExecutorClient(cluster["r"].target, timeout=30) as one:
        chosen, rows, handle = greedy(one, tokens, n)
        one.release_cache(handle)
    return chosen, rows


def test_prompts_run_on_prefill_replicas_and_decodes_on_the_decode_replica(healthy):
    cluster = healthy
    want_tokens, want_rows = reference(cluster, prompt(10, seed=1), 6)
    before = counters(cluster, "p1", "p2", "d")
    with replica_set(cluster) as rs:
        tokens, rows, handle = greedy(rs, prompt(10, seed=1), 6)
        assert rs.replica_of(handle) == cluster["d"].target
        rs.release_cache(handle)
        after = counters(cluster, "p1", "p2", "d")
        assert after["d"] == (before["d"][0], before["d"][1] + 6)  # every decode, no prompt
        assert sum(after[p][0] - before[p][0] for p in ("p1", "p2")) == 1
        assert all(after[p][1] == before[p][1] for p in ("p1", "p2"))
        assert tokens == want_tokens
        assert all(np.array_equal(x, y) for x, y in zip(rows, want_rows))  # moved bit for bit

        # token choice on the server, decoding ahead and a decode session on moved sequences
        want = reference(cluster, prompt(12, seed=2), 8)[0]
        for server_side in (True, False):
            assert list(generate_ids(rs, prompt(12, seed=2), 8, GREEDY, server_side=server_side)) == want
        first = rs.prefill(prompt(12, seed=2), token_choice=TokenChoice.greedy())
        ahead = rs.decode_ahead(first.chosen.token_id, first.kv_cache, TokenChoice.greedy(), 7)
        assert [first.chosen.token_id] + [c.token_id for c in ahead.chosen][:7] == want
        assert rs.replica_of(ahead.kv_cache) == cluster["d"].target
        rs.release_cache(ahead.kv_cache)
        first = rs.prefill(prompt(12, seed=2), token_choice=TokenChoice.greedy())
        with rs.decode_session() as session:
            handle, got = first.kv_cache, [first.chosen.token_id]
            for _ in range(7):
                step = session.step([(got[-1], handle)], token_choice=TokenChoice.greedy())[0]
                handle = step.kv_cache
                got.append(step.chosen.token_id)
        assert got == want and rs.replica_of(handle) == cluster["d"].target
        rs.release_cache(handle)
        end = counters(cluster, "p1", "p2", "d")
        assert end["d"][0] == before["d"][0]  # still no prompt on the decode replica
        assert all(end[p][1] == before[p][1] for p in ("p1", "p2"))


def test_asyncio_replica_set_moves_batches_to_the_decode_replica(healthy):
    cluster = healthy
    prompts = [prompt(9, seed=s) for s in (3, 4)]
    want = [reference(cluster, p, 5)[0] for p in prompts]
    before = counters(cluster, "d")["d"]

    async def run():
        async with replica_set(cluster, AsyncReplicaSetClient) as rs:
            outs = await rs.batch_prefill(prompts, token_choice=TokenChoice.greedy())
            got = [[o.chosen.token_id] for o in outs]
            handles = [o.kv_cache for o in outs]
            for _ in range(4):
                steps = await rs.batch_decode([(g[-1], h) for g, h in zip(got, handles)],
                                              token_choice=TokenChoice.greedy())
                handles = [s.kv_cache for s in steps]
                for g, s in zip(got, steps):
                    g.append(s.chosen.token_id)
            owners = {await rs.replica_of(h) for h in handles}
            for h in handles:
                await rs.release_cache(h)
            return got, owners

    got, owners = asyncio.run(run())
    assert got == want and owners == {cluster["d"].target}
    assert counters(cluster, "d")["d"][0] == before[0]


def test_a_refused_move_leaves_the_sequence_decoding_on_its_prefill_replica(healthy, caplog):
    cluster = healthy
    long = prompt(DECODE_POOL + 20, seed=5)  # more than the decode replica's whole pool
    want = reference(cluster, long, 4)
    with replica_set(cluster) as rs, caplog.at_level(logging.INFO, "ferrum_rpc.client"):
        before = counters(cluster, "d")["d"]
        tokens, rows, handle = greedy(rs, long, 4)
        assert rs.replica_of(handle) in (cluster["p1"].target, cluster["p2"].target)
        assert counters(cluster, "d")["d"] == before  # refused: nothing taken, nothing run there
        assert (tokens, len(rows)) == (want[0], 4)
        assert all(np.array_equal(x, y) for x, y in zip(rows, want[1]))
        assert "KV_CAPACITY_EXHAUSTED" in caplog.text and "decodes there" in caplog.text
        rs.release_cache(handle)


def test_a_dead_decode_replica_before_or_after_the_move_loses_nothing(healthy, caplog):
    cluster = healthy
    want = reference(cluster, prompt(8, seed=7), 6)[0]
    with replica_set(cluster) as rs, caplog.at_level(logging.WARNING, "ferrum_rpc.client"):
        # after the move: the decode replica dies, the failover replays it (on a prefill replica)
        out = rs.prefill(prompt(8, seed=7))
        tokens = [int(out.logits.argmax()[0])]
        step = rs.decode(tokens[-1], out.kv_cache)
        assert rs.replica_of(step.kv_cache) == cluster["d"].target
        cluster["d"].kill()
        for _ in range(5):
            tokens.append(int(step.logits.argmax()[0]))
            step = rs.decode(tokens[-1], step.kv_cache)
        assert tokens == want and rs.replica_of(step.kv_cache) != cluster["d"].target
        assert "no decode replica usable" in caplog.text
        rs.release_cache(step.kv_cache)

        # before the move: no decode replica, so the sequence stays on its prefill replica
        tokens, _, handle = greedy(rs, prompt(8, seed=7), 6)
        assert tokens == want and rs.replica_of(handle) in (cluster["p1"].target, cluster["p2"].target)
        assert "decodes there" in caplog.text
        rs.release_cache(handle)


def test_dead_prefill_replicas_send_prompts_to_another_or_to_any(healthy, caplog):
    cluster = healthy
    want = reference(cluster, prompt(8, seed=6), 4)[0]
    cluster["p1"].kill()
    with replica_set(cluster) as rs, caplog.at_level(logging.WARNING, "ferrum_rpc.client"):
        before = counters(cluster, "p2", "d")
        tokens, _, handle = greedy(rs, prompt(8, seed=6), 4)
        after = counters(cluster, "p2", "d")
        assert after["p2"][0] == before["p2"][0] + 1 and after["d"][0] == before["d"][0]
        assert tokens == want and rs.replica_of(handle) == cluster["d"].target
        rs.release_cache(handle)

        cluster["p2"].kill()  # no prefill replica left: the prompt goes to the decode replica
        tokens, _, handle = greedy(rs, prompt(8, seed=6), 4)
        assert counters(cluster, "d")["d"][0] == after["d"][0] + 1
        assert tokens == want and rs.replica_of(handle) == cluster["d"].target
        assert "no prefill replica usable" in caplog.text
        rs.release_cache(handle)


def test_roles_for_unknown_replicas_or_roles_are_refused(cluster):
    targets = [cluster["p1"].target, cluster["d"].target]
    with pytest.raises(ValueError, match="none of the replicas"):
        ReplicaSetClient(targets, replica_policy=ReplicaPolicy(roles={"127.0.0.1:1": "prefill"}))
    with pytest.raises(ValueError, match="expected"):
        ReplicaSetClient(targets, replica_policy=ReplicaPolicy(roles={targets[0]: "decoder"}))
