"""ferrum-engine-load (clients/rust: Ferrum's ContinuousEngine over RemoteExecutor serving
a timed workload of token-id prompts, the serving benchmark's Ferrum caller) against a
real SmolLM2 server: each request's ids equal the Python client's greedy generate_ids
for the same prompt, its per-token times rise from its arrival on, and a request the
engine refuses is reported on its own line without disturbing the others.

Built and skipped as the other Rust tests are (tests/contract/test_rust_client.py's
rust_bin: skipped without cargo unless FERRUM_REQUIRE_RUST=1).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from tests.conftest import running_server
from tests.contract.test_rust_client import rust_bin  # noqa: F401 (fixture)
from tests.waiting import wait_for

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.sampling import SamplingParams

pytestmark = pytest.mark.timeout(2400)  # the first Rust test waits for the crate's build

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
MAX_TOKENS = [6, 9, 4]
ARRIVALS = [0.0, 0.05, 0.4]


@pytest.fixture(scope="module")
def smol(default_model_dir):
    with running_server(default_model_dir, name="SmolLM2-135M-Instruct", kv_tokens=4096, block_size=16,
                        server_kwargs=dict(warmup=False)) as srv:
        yield srv


def load(rust_bin: Path, target: str, tokenizer: Path, workload: list[dict], *extra: str):  # noqa: F811
    done = subprocess.run([str(rust_bin / "ferrum-engine-load"), "--addr", target, "--tokenizer", str(tokenizer),
                           *extra], input=json.dumps(workload), capture_output=True, text=True, timeout=300)
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    return done, {line["index"]: line for line in lines}


def test_engine_load_ids_and_times(rust_bin, smol, default_model_dir):  # noqa: F811
    from tokenizers import Tokenizer

    tokenizer = Path(default_model_dir) / "tokenizer.json"
    prompt_ids = [Tokenizer.from_file(str(tokenizer)).encode(p).ids for p in PROMPTS]
    with ExecutorClient(smol.target, timeout=60) as c:
        vocab = c.info().vocab_size
        # No stop ids: the program runs each request to its max_tokens, EOS or not.
        want = [list(generate_ids(c, ids, n, SamplingParams(greedy=True))) for ids, n in zip(prompt_ids, MAX_TOKENS)]
    workload = [{"arrival_s": a, "prompt_ids": ids, "max_tokens": n}
                for a, ids, n in zip(ARRIVALS, prompt_ids, MAX_TOKENS)]
    # A fourth request the engine must refuse (a prompt id past the vocabulary).
    workload.append({"arrival_s": 0.1, "prompt_ids": [vocab + 7], "max_tokens": 3})

    done, got = load(rust_bin, smol.target, tokenizer, workload)
    assert sorted(got) == [0, 1, 2, 3], done.stdout + done.stderr
    assert done.returncode == 1, done.stderr  # one request failed
    bad = got[3]
    assert bad["error"] and bad["ids"] == [] and bad["times"] == [], bad
    for i in range(3):
        line = got[i]
        assert line["error"] is None, line
        assert line["ids"] == want[i], f"request {i}: engine {line['ids']}, generate_ids {want[i]}"
        times = line["times"]
        assert len(times) == MAX_TOKENS[i]
        assert line["arrival_s"] == ARRIVALS[i] <= line["submitted_s"] <= times[0]
        assert all(a < b for a, b in zip(times, times[1:])), times
    # The engine released every sequence itself before the program ended.
    assert "released here" not in done.stderr, done.stderr
    with ExecutorClient(smol.target, timeout=30) as c:
        wait_for(lambda: c.status().active_sequences, 10, f"no live sequence (program's stderr: {done.stderr[-2000:]})",
                 until=lambda n: n == 0)


def english_ids(default_model_dir, n: int) -> list[int]:
    """``n`` token ids of English text. Not arbitrary ids: Ferrum's engine never
    generates a token that decodes to a lone byte fragment (its token policy), and
    greedy on arbitrary ids picks such tokens where generate_ids, which forbids nothing,
    takes them."""
    text = (Path(__file__).resolve().parents[1] / "data" / "english.txt").read_text()
    ids = Tokenizer.from_file(str(Path(default_model_dir) / "tokenizer.json")).encode(text).ids
    return (ids * (n // len(ids) + 1))[:n]


def test_engine_load_prompt_longer_than_a_step(rust_bin, smol, default_model_dir):  # noqa: F811
    """A prompt longer than Ferrum's own per-step token budget (2,048, asked for here) is
    prefilled in chunks, each continuing the sequence the first made (a continuation
    carries no request_id: the server refuses one there)."""
    prompt = english_ids(default_model_dir, 2100)
    with ExecutorClient(smol.target, timeout=120) as c:
        want = list(generate_ids(c, prompt, 2, SamplingParams(greedy=True)))
    done, got = load(rust_bin, smol.target, Path(default_model_dir) / "tokenizer.json",
                     [{"arrival_s": 0.0, "prompt_ids": prompt, "max_tokens": 2}], "--step-tokens", "2048")
    assert got[0]["error"] is None, got[0]["error"]
    assert got[0]["ids"] == want and done.returncode == 0


def test_engine_load_steps_keep_to_the_step_budget(rust_bin, smol, default_model_dir, tmp_path):  # noqa: F811
    """--step-tokens bounds every engine step, decodes and prompt chunks together: a
    700-token prompt arriving while another request decodes is prefilled over several
    steps that keep decoding the first (Ferrum's scheduler trace says what each step
    carried), and both requests' ids equal generate_ids'. (100, not the program's
    default, so that the option is what bounds them.)"""
    budget = 100
    short, long_ = english_ids(default_model_dir, 20), english_ids(default_model_dir, 720)[20:]
    with ExecutorClient(smol.target, timeout=120) as c:
        want = [list(generate_ids(c, p, n, SamplingParams(greedy=True))) for p, n in ((short, 40), (long_, 3))]
    trace = tmp_path / "trace.jsonl"
    done, got = load(rust_bin, smol.target, Path(default_model_dir) / "tokenizer.json",
                     [{"arrival_s": 0.0, "prompt_ids": short, "max_tokens": 40},
                      {"arrival_s": 0.1, "prompt_ids": long_, "max_tokens": 3}],
                     "--step-tokens", str(budget), "--scheduler-trace", str(trace))
    assert done.returncode == 0, done.stderr[-2000:]
    assert [got[0]["ids"], got[1]["ids"]] == want
    plans = [e["plan"] for e in map(json.loads, trace.read_text().splitlines())
             if e.get("event") == "scheduler_iteration" and e.get("result") == "some_ok"]
    assert sum(p["prefill_tokens"] for p in plans) == len(short) + len(long_), plans
    assert max(p["prefill_tokens"] + p["decode_tokens"] for p in plans) <= budget, plans
    # The long prompt went in at least ceil(700 / 100) steps, and some carried a decode.
    assert sum(1 for p in plans if p["prefill_tokens"] > 0) >= -(-len(long_) // budget), plans
    assert any(p["prefill_tokens"] > 0 and p["decode_items"] > 0 for p in plans), plans
