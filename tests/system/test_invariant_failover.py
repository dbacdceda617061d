"""One seed, one text, under load and across replicas: two ``ferrum-rpc serve``
processes (batch-invariant by default; each test checks they say so) behind a replica-set client, sixteen seeded
generations keeping both busy, and one more whose replica is SIGKILLed (or drained
by migration) in the middle.  Every round, each generation's tokens and logprobs
equal, bit for bit, the same seed's generated alone on an idle server: the replay
by prefill on the survivor (kill) and the KV pushed to it (drain) continue with the
logits the sequence would have had, whichever other rows shared its forwards.

``FERRUM_STRIKE_ROUNDS`` sets the rounds (1 by default; the figures in the notes
come from 10)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from ferrum_rpc.client import ExecutorClient, TokenChoice, connect
from ferrum_rpc.client.replicas import ReplicaPolicy
from ferrum_rpc.harness import ServerProcess, all_serving

ROUNDS = int(os.environ.get("FERRUM_STRIKE_ROUNDS", "1"))
LOAD = 16
TOKENS = 24
KILL_AT = 8
FAST = ReplicaPolicy(status_ttl_s=0.5, down_cooldown_s=0.3, seed=0, kv_events=False)
FLAGS = ("--kv-tokens", "4096", "--block-size", "4", "--no-warmup", "--threads", "1",
         "--grace", "10", "--prefill-chunk", "8", "--step-token-budget", "24", "--max-batch", "32")


def _prompt(i: int) -> list[int]:
    return [(13 * i + 7 * j + 3) % 290 + 5 for j in range(6 + (5 * i) % 23)]


def _generate(client, i: int, seed: int, on_token=None) -> list:
    """Prompt ``i``'s seeded generation, step by step: each chosen token with its
    logprob and top logprobs, which carry the logits' bits (a logit that moved in its
    last bit moves them, where a sampled token would rarely change)."""
    choice = TokenChoice(temperature=1.0, seed=seed, top_logprobs=3)
    out = client.prefill(_prompt(i), token_choice=choice)
    got, handle = [out.chosen], out.kv_cache
    while len(got) < TOKENS:
        if on_token is not None:
            on_token(len(got))
        out = client.decode(got[-1].token_id, handle, token_choice=choice)
        got.append(out.chosen)
        handle = out.kv_cache
    client.release_cache(handle)
    return got


@pytest.fixture(scope="module")
def replicas(tiny_llama_dir):
    with all_serving(*(ServerProcess(f"tiny={tiny_llama_dir}", *FLAGS, "--export-grace", "20")
                       for _ in range(2))) as servers:
        yield servers


@pytest.fixture(scope="module")
def alone(replicas):
    """Each (prompt, seed)'s generation alone on an idle server (the first replica, asked
    at the start of a round, before the load begins)."""
    cache: dict = {}

    def text(i: int, seed: int) -> list:
        if (i, seed) not in cache:
            with ExecutorClient(replicas[0].target, timeout=30) as one:
                cache[(i, seed)] = _generate(one, i, seed)
        return cache[(i, seed)]
    return text


def _round(replicas, alone, n: int, how: str) -> None:
    """Sixteen loaded generations and the target (prompt ``n``), whose owner gets
    ``how`` (SIGKILL or SIGTERM) once it has produced KILL_AT tokens."""
    seeds = [1000 * n + i for i in range(LOAD + 1)]
    want = [alone(i, s) for i, s in enumerate(seeds)]
    by_target = {r.target: r for r in replicas}
    hit: list[str] = []
    started = threading.Barrier(LOAD + 1, timeout=60)
    with connect([r.target for r in replicas], timeout=60, replica_policy=FAST) as ex:
        def strike(count: int) -> None:
            if count == KILL_AT:
                prompt = tuple(_prompt(0))
                (owner,) = {s.replica for s in ex.live_sequences() if s.tokens[:len(prompt)] == prompt}
                hit.append(owner)
                if how == "kill":
                    by_target[owner].kill()
                else:
                    by_target[owner].proc.send_signal(signal.SIGTERM)

        def run(i: int) -> list[int]:
            started.wait()
            return _generate(ex, i, seeds[i], strike if i == 0 else None)

        with ThreadPoolExecutor(LOAD + 1) as pool:
            got = list(pool.map(run, range(LOAD + 1)))
    assert hit, "the target never reached the strike"
    assert got[0] == want[0], f"round {n}: the struck generation changed"
    assert got[1:] == want[1:], f"round {n}: a loaded generation changed"
    victim = by_target[hit[0]]
    if how == "drain":
        assert victim.proc.wait(60) == 0
    victim.restart()


@pytest.mark.parametrize("how", ["kill", "drain"])
def test_struck_generation_keeps_its_text_under_load(replicas, alone, how):
    for replica in replicas:  # the default configuration
        with ExecutorClient(replica.target, timeout=30) as client:
            assert client.capabilities().batch_invariant
    for n in range(ROUNDS):
        _round(replicas, alone, n, how)
