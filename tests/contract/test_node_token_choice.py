"""The Node.js client (clients/node: grpc-js + proto-loader on the .proto alone) lets the
server choose the tokens: ``generateSampled`` (run by ``sample.js``) against a real
server gives the same tokens for the same seed, in two separate node processes, and
the tokens (and logprobs) the Python client gets with the same TokenChoice."""

from __future__ import annotations

import json
import subprocess

import pytest

from ferrum_rpc.client import ExecutorClient, TokenChoice
from tests.conftest import running_server
from tests.node_env import node_packages

PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]
STEPS = 16
CHOICE = dict(temperature=0.8, top_k=40, top_p=0.95, seed=20261123)


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir) as s:
        yield s


def _node_sample(target: str, temperature: float, top_k: int, top_p: float, seed: int) -> dict:
    node_dir = node_packages()
    cmd = ["node", "sample.js", target, *map(str, PROMPT), "--tokens", str(STEPS), "--temperature", str(temperature),
           "--top-k", str(top_k), "--top-p", str(top_p), "--seed", str(seed)]
    done = subprocess.run(cmd, cwd=node_dir, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def _python_sample(target: str, choice: TokenChoice) -> tuple[list[int], list[float]]:
    with ExecutorClient(target, timeout=60) as ex:
        out = ex.prefill(PROMPT, token_choice=choice)
        assert out.logits is None
        chosen, handle = [out.chosen], out.kv_cache
        while len(chosen) < STEPS:
            out = ex.decode(chosen[-1].token_id, handle, token_choice=choice)
            chosen.append(out.chosen)
            handle = out.kv_cache
        ex.release_cache(handle)
    return [c.token_id for c in chosen], [c.logprob for c in chosen]


def test_node_seeded_sampling_repeats_and_equals_the_python_clients(server):
    first = _node_sample(server.target, **CHOICE)
    again = _node_sample(server.target, **CHOICE)
    assert len(first["tokens"]) == STEPS
    assert first["tokens"] == again["tokens"]
    # logprobs may differ in the last bits from one forward to another (as the logits do)
    assert first["logprobs"] == pytest.approx(again["logprobs"], rel=1e-5, abs=1e-5)

    tokens, logprobs = _python_sample(server.target, TokenChoice(**CHOICE))
    assert first["tokens"] == tokens
    assert first["logprobs"] == pytest.approx(logprobs, rel=1e-5, abs=1e-5)
    assert all(lp <= 0 for lp in logprobs)

    # the seed matters: another one draws another sequence
    other = _node_sample(server.target, **{**CHOICE, "seed": CHOICE["seed"] + 1})
    assert other["tokens"] != first["tokens"]
    with ExecutorClient(server.target, timeout=60) as ex:
        assert ex.status().active_sequences == 0  # node released what it made
