"""The Rust crate (clients/rust) against real servers, compared with the Python client on
the same server: greedy and seeded token ids and float32 logits bytes, every error row's
code and reason, every RPC through the typed Rust API; and Ferrum's own engine
(ContinuousEngine with RemoteExecutor, the ferrum-engine-generate program) on
SmolLM2: its greedy ids equal generate_ids', alone and 8 at once, a cancelled request
leaves no sequence, and a server killed mid-generation ends the engine's requests with
an error naming the reason; and Ferrum's engine on its own in-process CPU executor
(ferrum-own-generate) generates text from the same model folder.

The crate is built once per session with `cargo build --release` into
cache_root()/"cargo-target" (outside the clone, so CI and later runs reuse it; a warm
build only checks freshness). Without cargo the tests are skipped, saying so; with
FERRUM_REQUIRE_RUST=1 (CI sets it) they fail instead. The first test waits for the
build: its timeout covers a cold build of Ferrum's crates on 2 cores.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import running_server
from tests.contract.test_cpp_client import ARGMAX, COMMON_ROWS, PROMPT, SEEDED, lines, outcome, python_rows
from tests.system.test_security import ALICE, pki, tokens_file  # noqa: F401 (fixtures)

from ferrum_rpc.client import ClientTls, ExecutorClient, LogitsPolicy
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.paths import cache_root
from ferrum_rpc.types import ServerState
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(2400)

ROOT = Path(__file__).resolve().parents[2]
CRATE = ROOT / "clients" / "rust"
SMOL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The three primary colors are", "In 1969, humans", "A haiku about rain:", "Rust is a language that"]
MAX_TOKENS = 16


def target_dir() -> Path:
    """Cargo's target folder: CARGO_TARGET_DIR where set (a private copy, so builds of
    other checkouts do not replace this one's binaries), else the shared cache's."""
    return Path(os.environ.get("CARGO_TARGET_DIR") or cache_root() / "cargo-target")


@pytest.fixture(scope="session")
def rust_bin() -> Path:
    cargo = shutil.which("cargo") or str(Path.home() / ".cargo" / "bin" / "cargo")
    missing = None
    if not Path(cargo).exists():
        missing = "cargo is missing (install a Rust toolchain with rustup)"
    elif not (os.environ.get("PROTOC") or shutil.which("protoc")):
        missing = "protoc is missing (apt-get install protobuf-compiler)"
    if missing:
        message = f"Rust client not built: {missing}"
        if os.environ.get("FERRUM_REQUIRE_RUST") == "1":
            pytest.fail(message)
        pytest.skip(message)
    env = dict(os.environ, CARGO_TARGET_DIR=str(target_dir()), FERRUM_PYTHON=sys.executable)
    done = subprocess.run(["nice", "-n", "10", cargo, "build", "--release", "--bins", "--examples"], cwd=CRATE,
                          env=env, capture_output=True, text=True, timeout=2300)
    assert done.returncode == 0, done.stderr[-6000:]
    return target_dir() / "release"


def run(rust_bin: Path, program: str, *args, check: bool = True, timeout: float = 180,
        env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run([str(rust_bin / program), *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **(env or {})))
    if check:
        assert done.returncode == 0, f"{program} {args}: {done.stderr[-4000:]}"
    return done


def ids(values) -> str:
    return ",".join(map(str, values))


@pytest.fixture(scope="module")
def server(tiny_llama_dir):
    with running_server(tiny_llama_dir) as srv:
        yield srv


@pytest.fixture
def py(server):
    with ExecutorClient(server.target, timeout=30) as c:
        yield c


# -- the typed client: tokens and logits bit for bit, errors, every RPC -------------------
def test_greedy_ids_equal_the_python_clients(rust_bin, server, py):
    out = py.prefill(PROMPT, logits=ARGMAX)
    want, handle = [int(out.logits.token_ids[0][0])], out.kv_cache
    for _ in range(11):
        step = py.decode(want[-1], handle, logits=ARGMAX)
        want.append(int(step.logits.token_ids[0][0]))
        handle = step.kv_cache
    py.release_cache(handle)
    got = lines(run(rust_bin, "ferrum-rust-check", "greedy", server.target, 12, ids(PROMPT)).stdout)
    assert [int(t) for t in got["greedy"]] == want


def test_seeded_decode_ahead_ids_equal_the_python_clients(rust_bin, server, py):
    out = py.prefill(PROMPT, token_choice=SEEDED)
    want = [out.chosen.token_id]
    result = py.decode_ahead(want[0], out.kv_cache, SEEDED, 23)
    want += [c.token_id for c in result.chosen]
    py.release_cache(result.kv_cache)
    got = lines(run(rust_bin, "ferrum-rust-check", "seeded", server.target, 24, ids(PROMPT)).stdout)
    assert [int(t) for t in got["seeded"]] == want


def test_float32_logits_bytes_equal_the_python_clients(rust_bin, server, py, tmp_path):
    got = lines(run(rust_bin, "ferrum-rust-check", "logits", server.target, ids(PROMPT), tmp_path).stdout)
    pre = py.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True))
    rows = np.ascontiguousarray(pre.logits.values, dtype=np.float32)
    assert got["prefill_shape"] == [str(len(PROMPT)), str(rows.shape[1])]
    assert (tmp_path / "prefill.f32").read_bytes() == rows.tobytes()
    dec = py.decode(int(np.argmax(rows[-1])), pre.kv_cache, logits=LogitsPolicy.full())
    assert (tmp_path / "decode.f32").read_bytes() == np.ascontiguousarray(dec.logits.values, dtype=np.float32).tobytes()
    py.release_cache(dec.kv_cache)


def test_error_rows_have_the_python_clients_reasons(rust_bin, server, py):
    rows, subject = python_rows(py, server.target)
    want = {name: outcome(rows[name]) for name in COMMON_ROWS}
    py.release_cache(subject)
    got = lines(run(rust_bin, "ferrum-rust-check", "errors", server.target, ",".join(COMMON_ROWS)).stdout)
    for name in COMMON_ROWS:
        assert got[name][:2] == want[name][:2], f"{name}: Rust {got[name]}, Python {want[name]}"
    assert got["subject_after"] == ["OK"], "a failed Rust call changed the sequence"
    # The flags come from the proto's table: a deadline is an unknown outcome, not retryable.
    assert got["deadline"][2:] == ["false", "true"]
    assert got["cache_not_found"][2:] == ["false", "false"]


def test_limit_rows_have_the_python_clients_reasons(rust_bin, tiny_llama_dir):
    with running_server(tiny_llama_dir, max_seq_len=32, kv_tokens=64, block_size=4) as srv, \
            ExecutorClient(srv.target, timeout=30) as py:
        rows, subject = python_rows(py, srv.target)
        want = {name: outcome(rows[name]) for name in ("too_long", "kv_exhausted")}
        py.release_cache(subject)
        got = lines(run(rust_bin, "ferrum-rust-check", "errors", srv.target, "too_long,kv_exhausted").stdout)
        assert got["too_long"][:2] == want["too_long"] == ["OUT_OF_RANGE", "SEQUENCE_TOO_LONG"]
        assert got["kv_exhausted"] == ["RESOURCE_EXHAUSTED", "KV_CAPACITY_EXHAUSTED", "true", "false"]
        assert want["kv_exhausted"] == ["RESOURCE_EXHAUSTED", "KV_CAPACITY_EXHAUSTED"]
        srv.app.servicer.gate.state = ServerState.DRAINING  # the flag SIGTERM's drain sets
        try:
            want = outcome(lambda: py.prefill([1, 2, 3]))
            got = lines(run(rust_bin, "ferrum-rust-check", "errors", srv.target, "prefill").stdout)
        finally:
            srv.app.servicer.gate.state = ServerState.SERVING
        assert want == ["UNAVAILABLE", "DRAINING"]
        assert got["prefill"] == ["UNAVAILABLE", "DRAINING", "true", "false"]


RPCS = ["GetModelInfo", "GetCapabilities", "GetStatus", "Prefill", "Decode", "BatchDecode", "ForwardVerify",
        "TruncateKv", "ReleaseCache", "DecodeSession", "ForkCache", "Forward", "SpeculativeDecode", "BatchPrefill",
        "ListModels", "LoadModel", "UnloadModel", "LoadAdapter", "UnloadAdapter", "ListAdapters", "UpdateWeights",
        "RegisterSharedMemory", "UnregisterSharedMemory", "ExportSequence", "ImportSequence", "CreateImportTicket",
        "PushSequence", "WatchKvEvents"]


def test_every_rpc_is_callable_through_the_rust_client(rust_bin, server):
    from ferrum_rpc.v1 import executor_pb2 as pb

    assert sorted(RPCS) == sorted(m.name for m in pb.DESCRIPTOR.services_by_name["ModelExecutor"].methods)
    got = lines(run(rust_bin, "ferrum-rust-check", "rpcs", server.target).stdout)
    assert sorted(got) == sorted(RPCS)
    # Each call reached the server and came back typed: OK, or a status of the contract
    # (the requests for admin and transfer calls are deliberately empty or refused).
    answered_ok = {"GetModelInfo", "GetCapabilities", "GetStatus", "Prefill", "Decode", "BatchDecode",
                   "ForwardVerify", "TruncateKv", "ReleaseCache", "DecodeSession", "ForkCache",
                   "SpeculativeDecode", "BatchPrefill", "ListModels", "ListAdapters", "ExportSequence",
                   "ImportSequence", "CreateImportTicket", "WatchKvEvents", "UnregisterSharedMemory"}
    for name in answered_ok:
        assert got[name] == ["OK"], f"{name}: {got[name]}"
    assert got["Forward"][0] == "UNIMPLEMENTED"
    for name in set(RPCS) - answered_ok - {"Forward"}:
        assert got[name][0] != "OK" and got[name][0] != "UNKNOWN", f"{name}: {got[name]}"


def test_tls_with_a_token(rust_bin, tiny_llama_dir, pki, tokens_file):  # noqa: F811
    kwargs = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), auth_tokens=tokens_file)
    with running_server(tiny_llama_dir, server_kwargs=kwargs) as srv, \
            ExecutorClient(srv.target, timeout=30, tls=ClientTls(ca=str(pki / "ca.pem"), server_name="localhost"),
                           token=ALICE) as py:
        out = py.prefill(PROMPT, token_choice=SEEDED)
        want = [out.chosen.token_id]
        result = py.decode_ahead(want[0], out.kv_cache, SEEDED, 11)
        want += [c.token_id for c in result.chosen]
        py.release_cache(result.kv_cache)
        tls = {"FERRUM_RPC_CA": str(pki / "ca.pem"), "FERRUM_RPC_SERVER_NAME": "localhost"}
        got = lines(run(rust_bin, "ferrum-rust-check", "seeded", srv.target, 12, ids(PROMPT),
                        env={**tls, "FERRUM_RPC_TOKEN": ALICE}).stdout)
        assert [int(t) for t in got["seeded"]] == want
        refused = run(rust_bin, "ferrum-rust-check", "greedy", srv.target, 2, ids(PROMPT), check=False,
                      env={**tls, "FERRUM_RPC_TOKEN": ""})
        assert refused.returncode == 1 and "UNAUTHENTICATED: " in refused.stderr
        plain = run(rust_bin, "ferrum-rust-check", "greedy", srv.target, 2, ids(PROMPT), check=False,
                    env={"FERRUM_RPC_TOKEN": ALICE})
        assert plain.returncode == 1 and "UNAVAILABLE" in plain.stderr  # no TLS: the handshake fails


def test_remote_executor_releases_its_sequence_on_drop(rust_bin, server, py):
    got = lines(run(rust_bin, "ferrum-rust-check", "engine-release", server.target, ids(PROMPT)).stdout)
    out = py.prefill(PROMPT, logits=ARGMAX)
    want, handle = [int(out.logits.token_ids[0][0])], out.kv_cache
    for _ in range(3):
        step = py.decode(want[-1], handle, logits=ARGMAX)
        want.append(int(step.logits.token_ids[0][0]))
        handle = step.kv_cache
    py.release_cache(handle)
    assert [int(t) for t in got["executor_ids"]] == want
    assert got["verify_rows"] == ["2"] and got["verify_then_truncate_same"] == ["1"]
    assert int(got["during"][0]) == int(got["before"][0]) + 1
    assert got["after"] == got["before"]


def test_remote_executors_decode_ahead_holds_the_engines_sequence(rust_bin, server, py):
    """RemoteExecutor under unified batches as Ferrum's engine sends them, decoding ahead
    in runs of 4 (chained over 10 greedy steps): the ids are the server's greedy ones; a
    step on a token the run did not predict, then a full-logits step, each cut the run's
    lead off first (their choices are those of the engine's own sequence); the release
    leaves nothing."""
    n = 10
    got = lines(run(rust_bin, "ferrum-rust-check", "engine-ahead", server.target, n, ids(PROMPT)).stdout)

    def argmax(tokens: list[int]) -> int:
        out = py.prefill(tokens, logits=ARGMAX)
        py.release_cache(out.kv_cache)
        return int(out.logits.token_ids[0][0])

    want: list[int] = []
    for _ in range(n + 1):
        want.append(argmax(list(PROMPT) + want))
    assert [int(t) for t in got["ahead_ids"]] == want
    diverted = argmax(list(PROMPT) + want[:n] + [7])
    assert int(got["diverted"][0]) == diverted
    assert int(got["full_argmax"][0]) == argmax(list(PROMPT) + want[:n] + [7, diverted])
    counts = {k: int(v) for k, v in (pair.split("=") for pair in got["counts"])}
    # runs: steps 1-4, 5-8, 9-12 (cut at 11 by the diverted step), the diverted step's
    # (cut by the full-logits step, a plain step)
    assert counts["ahead_runs"] == 4 and counts["ahead_served"] == n + 1 and counts["ahead_cut"] == 2, counts
    assert counts["session_steps"] == 1, counts
    assert got["released"] == ["1"] and got["after"] == got["before"]


def test_remote_executors_failed_decode_ahead_run_leaves_the_engines_sequences(rust_bin, tiny_llama_dir, py):
    """A decode-ahead run of two sequences that fails part way on the server, after one
    of them ended: A (29 tokens, sequences end at 32) ends with MAX_SEQUENCE_LENGTH after
    3 forwards; B (one full block) goes on into the pool's last free block and fails
    KV_CAPACITY_EXHAUSTED at its next one; the server undoes the run for both. A,
    settled only after that (the engine truncates it by one), gets its taken tokens
    appended again before the cut, and its next full-logits step is the greedy token
    of its prefix; B, stepped on after A's release, replays its taken tokens and goes
    on with generate_ids' greedy ids."""
    a = [(5 + 7 * i) % 250 + 1 for i in range(29)]
    b = [301, 302, 303, 304]

    def argmax(tokens: list[int]) -> int:  # a fresh server's (the module's), with room
        out = py.prefill(tokens, logits=ARGMAX)
        py.release_cache(out.kv_cache)
        return int(out.logits.token_ids[0][0])

    # the pool: A's 8 blocks, B's 1 and one free
    with running_server(tiny_llama_dir, max_seq_len=32, kv_tokens=40, block_size=4) as srv:
        got = lines(run(rust_bin, "ferrum-rust-check", "engine-ahead-fail", srv.target, ids(a), ids(b)).stdout)
        with ExecutorClient(srv.target, timeout=30) as c:
            wait_for(lambda: c.status().active_sequences == 0, timeout=10, what="the sequences released")
    want_a: list[int] = []
    for _ in range(4):
        want_a.append(argmax(a + want_a))
    assert [int(t) for t in got["a_ids"]] == want_a
    # the run was undone (B's spare block free again) before A was settled
    assert got["free_before"] == ["1"] and got["free_undone"] == ["1"], got
    assert got["a_truncated"] == [str(len(a) + 2)]
    assert int(got["a_next"][0]) == want_a[3] and got["a_len"] == [str(len(a) + 3)]
    want_b = list(generate_ids(py, b, 8, SamplingParams(greedy=True)))
    assert [int(t) for t in got["b_ids"]] == want_b
    counts = {k: int(v) for k, v in (pair.split("=") for pair in got["counts"])}
    # runs: A and B's (failed), B's after its replay; both sequences replayed
    assert counts["ahead_runs"] == 2 and counts["ahead_replayed"] == 2, counts
    assert got["released"] == ["1"]


def test_remote_executor_redoes_what_a_lost_session_undid(rust_bin, server, py):
    """The executor's DecodeSession stream ends (cancelled, as a lost connection ends it)
    after a decode-ahead run whose tokens the engine all took (A), and after a plain step
    (B), before a later request on the stream named the sequence: the server undoes the
    run and the step (a block freed each time). The engine steps on: each sequence is
    brought back to the engine's length first (`resynced`), its ids are generate_ids'
    greedy ones, and the releases leave no sequence. C is B stepping on at once, without
    waiting for the server to undo: the server may abandon the session only after the
    executor redid the step, and that late undo must not take the redone step back."""
    a = [(5 + 7 * i) % 250 + 1 for i in range(8)]
    b = [301, 302, 303, 304, 305, 306, 307, 308]
    # the module's server: blocks of 4 tokens (each prompt fills two)
    got = lines(run(rust_bin, "ferrum-rust-check", "engine-break", server.target, ids(a), ids(b)).stdout)
    assert got["a_freed"] == ["1"] and got["b_freed"] == ["1"], got
    assert [int(t) for t in got["a_ids"]] == list(generate_ids(py, a, 8, SamplingParams(greedy=True)))
    assert [int(t) for t in got["b_ids"]] == list(generate_ids(py, b, 5, SamplingParams(greedy=True)))
    assert got["c_ids"] == got["b_ids"]
    for name, runs in (("a", 2), ("b", 0), ("c", 0)):
        counts = {k: int(v) for k, v in (pair.split("=") for pair in got[f"{name}_counts"])}
        assert counts["resynced"] == 1 and counts["ahead_runs"] == runs, counts
    assert got["a_released"] == got["b_released"] == got["c_released"] == ["1"]
    assert got["after"] == got["before"]


def test_the_readmes_example_is_the_built_one(rust_bin):
    import re

    snippet = re.search(r"```rust\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    example = (CRATE / "examples" / "greedy.rs").read_text()
    assert example.split("\n", 1)[1] == snippet
    assert (rust_bin / "examples" / "greedy").exists()


# -- Ferrum's engine on SmolLM2 -------------------------------------------------------------
@pytest.fixture(scope="module")
def smol(default_model_dir):
    with running_server(default_model_dir, name=SMOL, kv_tokens=8192, block_size=16,
                        server_kwargs=dict(warmup=False)) as srv:
        yield srv


@pytest.fixture(scope="module")
def python_greedy(smol, default_model_dir):
    """generate_ids' greedy ids for each prompt, tokenized as tokenizers' encode(text)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(default_model_dir) / "tokenizer.json"))
    with ExecutorClient(smol.target, timeout=60) as c:
        eos = set(c.info().eos_token_ids)
        return [list(generate_ids(c, tok.encode(p).ids, MAX_TOKENS, SamplingParams(greedy=True), stop_ids=eos))
                for p in PROMPTS]


def engine_ids(rust_bin, target: str, prompts: list[str], concurrency: int, default_model_dir,
               *options) -> list[list[int]]:
    done = run(rust_bin, "ferrum-engine-generate", "--addr", target, "--max-tokens", MAX_TOKENS, "--concurrency",
               concurrency, "--tokenizer", Path(default_model_dir) / "tokenizer.json", "--ids", *options, *prompts,
               timeout=300)
    out = done.stdout.splitlines()
    assert len(out) == len(prompts), done.stdout
    return [[int(t) for t in line.split()] for line in out]


def test_ferrum_engine_greedy_equals_generate_ids_alone(rust_bin, smol, default_model_dir, python_greedy):
    got = [engine_ids(rust_bin, smol.target, [p], 1, default_model_dir)[0] for p in PROMPTS]
    assert got == python_greedy


def test_ferrum_engine_eight_at_once_equal_each_alone(rust_bin, smol, default_model_dir, python_greedy):
    got = engine_ids(rust_bin, smol.target, PROMPTS, 8, default_model_dir)
    assert got == python_greedy
    with ExecutorClient(smol.target, timeout=30) as c:
        wait_for(lambda: c.status().active_sequences, 10, "no live sequence", until=lambda n: n == 0)


def test_ferrum_engine_in_short_decode_ahead_runs_equals_each_alone(rust_bin, smol, default_model_dir,
                                                                    python_greedy):
    """Decode-ahead runs of 3 tokens: each sequence's run ends long before its request
    does and the next starts from the engine's step, 8 sequences share runs and leave
    them at different times (EOS); the ids stay generate_ids' and nothing is left."""
    got = engine_ids(rust_bin, smol.target, PROMPTS, 8, default_model_dir, "--decode-ahead", 3)
    assert got == python_greedy
    with ExecutorClient(smol.target, timeout=30) as c:
        wait_for(lambda: c.status().active_sequences, 10, "no live sequence", until=lambda n: n == 0)


def test_ferrum_engine_within_the_servers_decode_ahead_seats(rust_bin, default_model_dir, python_greedy):
    """A server that lets a tenant decode ahead 3 sequences at a time refuses the
    executor's run of 8 (TENANT_QUOTA_EXCEEDED): those steps go plain and later runs
    stay within what the server allows; the ids stay generate_ids' and nothing is left."""
    with running_server(default_model_dir, name=SMOL, kv_tokens=8192, block_size=16, tenant_ahead_sequences=3,
                        server_kwargs=dict(warmup=False)) as srv:
        done = run(rust_bin, "ferrum-engine-generate", "--addr", srv.target, "--max-tokens", MAX_TOKENS,
                   "--concurrency", 8, "--tokenizer", Path(default_model_dir) / "tokenizer.json", "--ids", "--timing",
                   *PROMPTS, timeout=300)
        assert [[int(t) for t in line.split()] for line in done.stdout.splitlines()[:-1]] == python_greedy
        calls = executor_calls(done.stderr)
        assert calls["ahead_runs"] >= 2 and calls["session_steps"] >= 1 and calls["ahead_served"] > 0, calls
        with ExecutorClient(srv.target, timeout=30) as c:
            wait_for(lambda: c.status().active_sequences, 10, "no live sequence", until=lambda n: n == 0)


def executor_calls(stderr: str) -> dict[str, int]:
    """The counts ferrum-engine-generate --timing prints on its "executor calls:" line."""
    line = next(x for x in stderr.splitlines() if x.startswith("executor calls:"))
    return {k: int(v) for k, v in (pair.split("=") for pair in line.split(":", 1)[1].split())}


def test_ferrum_engine_steps_over_one_session(rust_bin, smol, default_model_dir, python_greedy):
    """Greedy and sampled requests step over the executor's DecodeSession, greedy with
    generate_ids' ids. Ferrum's greedy mask forbids some of SmolLM2's tokens: it goes as
    the allowed-token bitmask and the server chooses every greedy decode token, decoding
    ahead (the steps answered from a run's tokens, the run as long as the request's
    remaining tokens, so no lead is cut off); sampled rows are full logits (Ferrum
    samples them), one plain session step each."""
    args = ("--addr", smol.target, "--max-tokens", MAX_TOKENS,
            "--tokenizer", Path(default_model_dir) / "tokenizer.json",
            "--ids", "--timing")
    greedy = run(rust_bin, "ferrum-engine-generate", *args, PROMPTS[0], timeout=300)
    ids = [int(t) for t in greedy.stdout.splitlines()[0].split()]
    assert ids == python_greedy[0]
    calls = executor_calls(greedy.stderr)
    assert calls["server_chosen"] >= len(ids) - 2 > 0 and calls["ahead_served"] >= len(ids) - 2, calls
    assert calls["ahead_runs"] >= 1 and calls["ahead_cut"] == 0, calls
    sampled = run(rust_bin, "ferrum-engine-generate", *args, "--temperature", "0.8", "--seed", "3", PROMPTS[0],
                  timeout=300)
    ids = sampled.stdout.splitlines()[0].split()
    calls = executor_calls(sampled.stderr)
    assert ids and calls["server_chosen"] == 0 and calls["session_steps"] >= len(ids) - 2, calls
    assert calls["ahead_runs"] == 0, calls


def test_ferrum_engine_text_is_generated(rust_bin, smol, default_model_dir):
    done = run(rust_bin, "ferrum-engine-generate", "--addr", smol.target, "--max-tokens", 8,
               "--tokenizer", Path(default_model_dir) / "tokenizer.json", PROMPTS[0], timeout=300)
    assert done.stdout.strip(), "no text"


def test_ferrum_own_executor_generates_text(rust_bin, default_model_dir):
    """ferrum-own-generate: Ferrum's engine on its own in-process CPU executor, loading
    the model folder itself (no server), answers the prompt greedily as the model does."""
    done = run(rust_bin, "ferrum-own-generate", "--model", default_model_dir, "--max-tokens", 8, PROMPTS[0],
               timeout=300)
    text = done.stdout.splitlines()[0]
    assert text.startswith(" Paris"), text


def test_a_request_cancelled_mid_generation_leaves_no_sequence(rust_bin, smol, default_model_dir):
    """The engine program interrupted (SIGINT after its first decode steps reached the
    server): its requests go with it, and the server holds no sequence of theirs."""
    with ExecutorClient(smol.target, timeout=30) as c:
        before = c.status()
        proc = subprocess.Popen([str(rust_bin / "ferrum-engine-generate"), "--addr", smol.target, "--max-tokens",
                                 "400", "--concurrency", "2",
                                 "--tokenizer", str(Path(default_model_dir) / "tokenizer.json"),
                                 "--ids", PROMPTS[0], PROMPTS[1]], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:

            def going():
                assert proc.poll() is None, "the program ended before generation got going"
                status = c.status()
                return status.active_sequences, status.forwards - before.forwards

            wait_for(going, 120, "(live sequences, forwards) of generation under way",
                     until=lambda o: o[0] >= 2 and o[1] >= 8)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 130, err
        # Ferrum's engine cancelled the requests and released their sequences itself
        # (the program's own release of leftovers had nothing to do).
        assert b"the engine released its sequences" in err and b"released here" not in err, err
        wait_for(lambda: c.status().active_sequences, 30, "no live sequence", until=lambda n: n == 0)


def test_server_killed_mid_generation_ends_with_the_reason(rust_bin, default_model_dir):
    with all_serving(ServerProcess(f"{SMOL}={default_model_dir}", "--kv-tokens", "4096", "--block-size", "16",
                                   "--no-warmup", "--threads", "1")) as (srv,):
        with ExecutorClient(srv.target, timeout=30) as c:
            start = c.status().forwards
            proc = subprocess.Popen([str(rust_bin / "ferrum-engine-generate"), "--addr", srv.target, "--max-tokens",
                                     "400", "--tokenizer", str(Path(default_model_dir) / "tokenizer.json"), "--ids",
                                     PROMPTS[0]], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:

                def forwards():
                    assert proc.poll() is None, "the program ended before generation got going"
                    return c.status().forwards - start

                wait_for(forwards, 120, "four forwards of generation", until=lambda n: n >= 4)
                srv.kill()
                out, err = proc.communicate(timeout=60)  # an error, not a hang
            finally:
                if proc.poll() is None:
                    proc.kill()
    assert proc.returncode == 1, (out, err)
    assert "UNAVAILABLE" in err, err
