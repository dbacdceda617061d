"""Prompts under load on a real server process (issue 20, items 9 and 10): parts are
shared round-robin across tenants, not across prompts, and a prompt starts only
when the pool can hold the whole of it beside the prompts already started."""

from __future__ import annotations

import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.system.test_replicas import Replica

ALICE, BOB = "alice-token-aaaaaaaaaaaaaaaaaaaa", "bob-token-bbbbbbbbbbbbbbbbbbbbbbb"
ARGMAX = pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX)


def _md(token):
    return [("authorization", f"Bearer {token}")]


def test_prompts_that_each_fit_do_not_fail_together(tiny_llama_dir):
    """Eight 200-token prompts at once on a 1,024-token pool: together they need 1,600
    tokens, so they cannot all run at once; each caller releases its sequence as soon
    as it has it, so every one must succeed (before: 3-5 failed half done)."""
    replica = Replica(tiny_llama_dir, "--step-token-budget", "64", "--prefill-chunk", "64")
    try:
        replica.wait_serving()
        with grpc.insecure_channel(replica.target) as channel:
            stub = pb_grpc.ModelExecutorStub(channel)

            def one(i: int) -> str:
                try:
                    out = stub.Prefill(pb.PrefillRequest(token_ids=[(7 * i + t) % 300 + 1 for t in range(200)],
                                                         logits=ARGMAX), timeout=60)
                except grpc.RpcError as exc:
                    return exc.details()
                stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=out.kv_cache.cache_id), timeout=60)
                return "ok"

            for _ in range(3):
                with ThreadPoolExecutor(8) as pool:
                    results = list(pool.map(one, range(8)))
                assert results == ["ok"] * 8, results
                st = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
                assert (st.active_sequences, st.kv_blocks_used) == (0, 0)
    finally:
        replica.kill()


@pytest.fixture
def two_tenants(tiny_llama_dir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text(f"alice {ALICE}\nbob {BOB}\n")
    # alice's 12 prompts hold 3,000 of the 4,096 KV tokens: past a tenant's default share
    replica = Replica(tiny_llama_dir, "--auth-tokens", str(tokens), "--kv-tokens", "4096", "--tenant-kv-tokens", "0",
                      "--step-token-budget", "32", "--prefill-chunk", "32")
    try:
        replica.wait_serving()
        with grpc.insecure_channel(replica.target) as channel:
            yield pb_grpc.ModelExecutorStub(channel)
    finally:
        replica.kill()


def test_a_short_prompt_is_not_queued_behind_another_tenants_long_ones(two_tenants):
    """Bob's 10-token prompt arrives behind Alice's 12 queued 250-token prompts (8 parts
    each): it must get a part within a forward or two, not after one part of each of
    hers.  Measured in the server's own times: Bob's queue time against the time of
    one forward."""
    stub = two_tenants
    ratios = []
    for r in range(3):  # new prompts each round: no prefix-cache hits
        alice_prompts = [[(11 * i + 13 * r + t) % 300 + 1 for t in range(250)] for i in range(12)]
        with ThreadPoolExecutor(13) as pool:
            alice = [pool.submit(stub.Prefill, pb.PrefillRequest(token_ids=p, logits=ARGMAX), metadata=_md(ALICE),
                                 timeout=60) for p in alice_prompts]
            # GetStatus's queue_depth does not show her prompts reliably while they run (it read 0
            # throughout in half the runs tried), so Bob's prompt goes out 50 ms after hers
            time.sleep(0.05)  # unobservable: no server figure shows her prompts queued
            bob = stub.Prefill(pb.PrefillRequest(token_ids=list(range(1 + r, 11 + r)), logits=ARGMAX), metadata=_md(BOB),
                               timeout=60)
            outs = [f.result() for f in alice]
        per_forward = statistics.median(o.timing.forward_ns / 8 for o in outs)  # 250 tokens in 32-token parts
        ratios.append(bob.timing.queue_ns / per_forward)
        for out in [*outs]:
            stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=out.kv_cache.cache_id), metadata=_md(ALICE), timeout=30)
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=bob.kv_cache.cache_id), metadata=_md(BOB), timeout=30)
    # before: Bob waited for one part of each of Alice's 12 prompts (a ratio near 12)
    assert statistics.median(ratios) < 4, f"Bob's queue time in forwards: {ratios}"
