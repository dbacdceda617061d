"""The C++ client (clients/cpp) against real servers, compared with the Python client on
the same server: greedy and seeded token ids, float32 logits bytes, every error row's
code and reason, a cancelled and a stopped decode-ahead run, TLS with a bearer token,
and every RPC of the contract through the typed C++ API.

The CMake project is built once per session into a cache folder (incremental after the
first build), unoptimized: the tests check behaviour, and an -O0 build of the generated
stubs compiles in about half the time of a Release one (bench/cpp_client.py builds Release). Without cmake, protoc's gRPC plugin or the gRPC C++ headers the tests are
skipped, saying so; with FERRUM_REQUIRE_CPP=1 (CI sets it) they fail instead.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tests.conftest import running_server
from tests.system.test_security import ALICE, pki, tokens_file  # noqa: F401 (fixtures)

from ferrum_rpc.client import ClientTls, ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.types import ServerState, TokenChoice

ROOT = Path(__file__).resolve().parents[2]
ARGMAX = LogitsPolicy.argmax()
SEEDED = TokenChoice(temperature=0.8, top_k=40, top_p=0.9, seed=7)
PROMPT = [1, 17, 42, 99, 7, 256, 3]


def _missing() -> str | None:
    for tool in ("cmake", "protoc", "grpc_cpp_plugin"):
        if shutil.which(tool) is None:
            return tool
    if not Path("/usr/include/grpcpp/grpcpp.h").exists() and not Path("/usr/local/include/grpcpp/grpcpp.h").exists():
        return "the gRPC C++ headers (libgrpc++-dev)"
    return None


def build_dir(optimized: bool = False) -> Path:
    """A build folder per checkout and build type under the user's cache (CMake rebuilds
    only what changed)."""
    home = Path(os.environ.get("FERRUM_RPC_HOME", Path.home() / ".cache" / "ferrum-rpc"))
    kind = "release" if optimized else "check"
    return home / "cpp-build" / f"{hashlib.sha1(str(ROOT).encode()).hexdigest()[:12]}-{kind}"


def cpp_bin_path(optimized: bool = False) -> Path:
    """Configures and builds clients/cpp (incrementally); the folder holding its programs.
    `optimized` builds Release (for timing); otherwise -O0 without debug info (for tests).
    Raises RuntimeError naming what is missing where it cannot be built."""
    missing = _missing()
    if missing:
        raise RuntimeError(f"C++ client not built: {missing} is missing "
                           "(apt-get install libgrpc++-dev protobuf-compiler-grpc cmake)")
    out = build_dir(optimized)
    build_type = ["-DCMAKE_BUILD_TYPE=Release"] if optimized else ["-DCMAKE_BUILD_TYPE=Debug", "-DCMAKE_CXX_FLAGS_DEBUG=-O0"]
    # A fresh clone's files are all newer than the last build's, so CMake would compile
    # everything again; a build of exactly these sources, flags and tools is used as it is.
    digest, stamp = _sources_digest(build_type), out / "sources.sha1"
    if stamp.exists() and stamp.read_text() == digest:
        return out
    stamp.unlink(missing_ok=True)  # a failed build leaves no stamp behind
    # This Python has googleapis-common-protos (grpcio-status): the google/rpc protos come from it.
    subprocess.run(["cmake", "-S", str(ROOT / "clients" / "cpp"), "-B", str(out), f"-DPython3_EXECUTABLE={sys.executable}",
                    *build_type], check=True, capture_output=True)
    build = subprocess.run(["cmake", "--build", str(out), "-j2"], capture_output=True, text=True)
    if build.returncode != 0:
        raise AssertionError(build.stdout[-4000:] + build.stderr[-4000:])
    stamp.write_text(digest)
    return out


def _sources_digest(flags: list[str]) -> str:
    """What a build of clients/cpp depends on: its files and protos/ (paths and bytes),
    the flags, this Python (the google/rpc protos' home) and the gRPC tools installed."""
    h = hashlib.sha256("\0".join([*flags, sys.executable]).encode())
    for folder in (ROOT / "clients" / "cpp", ROOT / "protos"):
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    for tool in ("cmake", "protoc", "grpc_cpp_plugin"):
        st = Path(shutil.which(tool)).resolve().stat()
        h.update(f"{tool} {st.st_size} {st.st_mtime_ns}".encode())
    return h.hexdigest()


@pytest.fixture(scope="session")
def cpp_bin() -> Path:
    missing = _missing()
    if missing:
        message = f"C++ client not built: {missing} is missing (apt-get install libgrpc++-dev protobuf-compiler-grpc cmake)"
        if os.environ.get("FERRUM_REQUIRE_CPP") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return cpp_bin_path()


def run(cpp_bin: Path, program: str, *args, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([str(cpp_bin / program), *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert done.returncode == 0, f"{program} {args}: {done.stderr}"
    return done


def lines(text: str) -> dict[str, list[str]]:
    return {parts[0]: parts[1:] for parts in (line.split() for line in text.splitlines()) if parts}


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


# -- tokens and logits, bit for bit ------------------------------------------------------
def test_greedy_ids_equal_the_python_clients(cpp_bin, server, py):
    out = py.prefill(PROMPT, logits=ARGMAX)
    want, handle = [int(out.logits.token_ids[0][0])], out.kv_cache
    for _ in range(11):
        step = py.decode(want[-1], handle, logits=ARGMAX)
        want.append(int(step.logits.token_ids[0][0]))
        handle = step.kv_cache
    py.release_cache(handle)
    got = lines(run(cpp_bin, "ferrum-cpp-check", "greedy", "--target", server.target, "--tokens", ids(PROMPT),
                    "--n", 12).stdout)
    assert [int(t) for t in got["greedy"]] == want


def python_seeded(py, max_tokens: int, stops=()) -> list[int]:
    """What ferrum-generate does, through the Python client: prefill with the choice, then decode ahead."""
    out = py.prefill(PROMPT, token_choice=SEEDED)
    tokens = [out.chosen.token_id]
    result = py.decode_ahead(tokens[0], out.kv_cache, SEEDED, max_tokens - 1, stop_token_ids=stops)
    tokens += [c.token_id for c in result.chosen]
    py.release_cache(result.kv_cache)
    return tokens


def generate(cpp_bin, target: str, max_tokens: int, stops=(), *extra) -> list[int]:
    done = run(cpp_bin, "ferrum-generate", "--target", target, "--tokens", ids(PROMPT), "--max-tokens", max_tokens,
               "--temperature", 0.8, "--top-k", 40, "--top-p", 0.9, "--seed", 7, "--stop", ids(stops), *extra)
    return [int(t) for t in done.stdout.split()]


def test_seeded_decode_ahead_ids_equal_the_python_clients(cpp_bin, server, py):
    want = python_seeded(py, 24)
    assert generate(cpp_bin, server.target, 24) == want
    stop = want[9]  # a stop token the run meets: both end on its first occurrence
    want_stopped = python_seeded(py, 24, [stop])
    assert want_stopped[-1] == stop and len(want_stopped) <= 10
    assert generate(cpp_bin, server.target, 24, [stop]) == want_stopped


def test_float32_logits_bytes_equal_the_python_clients(cpp_bin, server, py, tmp_path):
    out = run(cpp_bin, "ferrum-cpp-check", "logits", "--target", server.target, "--tokens", ids(PROMPT),
              "--out", tmp_path).stdout
    got = lines(out)
    pre = py.prefill(PROMPT, logits=LogitsPolicy.full(all_positions=True))
    rows = np.ascontiguousarray(pre.logits.values, dtype=np.float32)
    assert got["prefill_shape"] == [str(len(PROMPT)), str(rows.shape[1])] and got["view_in_place"] == ["1"]
    assert (tmp_path / "prefill.f32").read_bytes() == rows.tobytes()
    nxt = int(np.argmax(rows[-1]))
    dec = py.decode(nxt, pre.kv_cache, logits=LogitsPolicy.full())
    assert (tmp_path / "decode.f32").read_bytes() == np.ascontiguousarray(dec.logits.values, dtype=np.float32).tobytes()
    top = py.forward_verify([nxt, 7], dec.kv_cache, logits=LogitsPolicy.topk(5, all_positions=True))
    assert got["topk_shape"] == ["2", "5"]
    cpp_rows = [line.split()[1:] for line in out.splitlines() if line.startswith("topk_row")]
    assert len(cpp_rows) == 2
    for r, row in enumerate(cpp_rows):  # TOP_K rows: the same ids in the same (descending) order, same scores
        pairs = [p.split(":") for p in row]
        assert [int(i) for i, _ in pairs] == list(map(int, top.logits.token_ids[r]))
        assert np.array_equal(np.array([float(s) for _, s in pairs], dtype=np.float32), top.logits.values[r])
    bf = py.forward_verify([nxt], top.kv_cache, logits=LogitsPolicy.full("bfloat16"))
    raw = (tmp_path / "verify.bf16").read_bytes()
    widened = np.frombuffer((tmp_path / "verify_widened.f32").read_bytes(), dtype=np.float32)
    assert np.array_equal(widened, np.asarray(bf.logits.values, dtype=np.float32).reshape(-1))
    assert len(raw) == 2 * widened.size
    py.release_cache(bf.kv_cache)


# -- the error table from C++: the same code and reason as from Python -------------------
def python_rows(py: ExecutorClient, target: str) -> dict:
    """The error rows ferrum-cpp-check runs, made through the Python client."""
    vocab = py.info().vocab_size
    subject = py.prefill(PROMPT[:6], logits=ARGMAX).kv_cache

    def prompt(n: int, seed: int = 0) -> list[int]:
        return [(37 * i + 11 + 101 * seed) % vocab for i in range(n)]

    def changed(**fields):
        from dataclasses import replace
        return replace(subject, **fields)

    def kv_exhausted():
        fillers = [py.prefill(prompt(28, seed), logits=ARGMAX).kv_cache for seed in (1, 2)]
        try:
            py.prefill(prompt(12))
        finally:
            for f in fillers:
                py.release_cache(f)

    return {
        "cache_not_found": lambda: py.decode(5, changed(cache_id="no-such-sequence")),
        "stale_handle": lambda: py.decode(5, changed(server_instance_id="another-server")),
        "length_mismatch": lambda: py.decode(5, changed(sequence_length=subject.sequence_length + 1)),
        "empty_prefill": lambda: py.prefill([]),
        "empty_verify": lambda: py.forward_verify([], subject),
        "token_outside_vocab": lambda: py.decode(vocab, subject),
        "bad_top_k": lambda: py.decode(5, subject, logits=LogitsPolicy.topk(0)),
        "bad_temperature": lambda: py.decode(5, subject, token_choice=TokenChoice(temperature=float("nan"))),
        "truncate_past_end": lambda: py.truncate_kv(subject, subject.sequence_length + 1),
        "release_unknown": lambda: py.release_cache(changed(cache_id="no-such-sequence")),
        "fork_unknown": lambda: py.fork_cache(changed(cache_id="no-such-sequence"), 2),
        "unknown_model": lambda: ExecutorClient(target, model="no-such-model", timeout=30).info(),
        "forward_unimplemented": lambda: _raw_forward(py),
        "ahead_too_many": lambda: py.decode_ahead(5, subject, TokenChoice(temperature=0.0), 5000),
        "ahead_bad_stop": lambda: py.decode_ahead(5, subject, TokenChoice(temperature=0.0), 4, [vocab]),
        "deadline": lambda: ExecutorClient(target, timeout=1e-9).prefill([1, 2, 3]),
        "too_long": lambda: py.prefill(prompt(py.info().max_sequence_length + 1)),
        "kv_exhausted": kv_exhausted,
        "prefill": lambda: py.release_cache(py.prefill([1, 2, 3]).kv_cache),
    }, subject


def outcome(fn) -> list[str]:
    try:
        fn()
    except ExecutorError as e:
        return [e.code.name, e.reason.value if e.reason else "-"]
    return ["OK"]


def compare_rows(cpp_bin, target: str, py: ExecutorClient, names: list[str]) -> dict:
    rows, subject = python_rows(py, target)
    want = {name: outcome(rows[name]) for name in names}
    py.release_cache(subject)
    got = lines(run(cpp_bin, "ferrum-cpp-check", "errors", "--target", target, "--rows", ",".join(names)).stdout)
    for name in names:
        assert got[name][:len(want[name])] == want[name] or (want[name] == ["OK"] and got[name][0] == "OK"), \
            f"{name}: C++ {got[name]}, Python {want[name]}"
    assert got["subject_after"][0] == "OK", "a failed C++ call changed the sequence"
    return got


COMMON_ROWS = ["cache_not_found", "stale_handle", "length_mismatch", "empty_prefill", "empty_verify",
               "token_outside_vocab", "bad_top_k", "bad_temperature", "truncate_past_end", "release_unknown",
               "fork_unknown", "unknown_model", "forward_unimplemented", "ahead_too_many", "ahead_bad_stop",
               "deadline"]


def test_error_rows_have_the_python_clients_reasons(cpp_bin, server, py):
    got = compare_rows(cpp_bin, server.target, py, COMMON_ROWS)
    assert got["forward_unimplemented"][:2] == ["UNIMPLEMENTED", "-"]
    assert got["cache_not_found"][:2] == ["NOT_FOUND", "CACHE_NOT_FOUND"]


def _raw_forward(py):
    """The Python client has no forward() (UNIMPLEMENTED by contract): the stub's call."""
    import grpc

    from ferrum_rpc.errors import from_rpc_error
    from ferrum_rpc.v1 import executor_pb2 as pb
    try:
        py._stub.Forward(pb.ForwardRequest(), timeout=10)
    except grpc.RpcError as exc:
        raise from_rpc_error(exc) from None


def test_limit_rows_have_the_python_clients_reasons(cpp_bin, tiny_llama_dir):
    with running_server(tiny_llama_dir, max_seq_len=32, kv_tokens=64, block_size=4) as srv, \
            ExecutorClient(srv.target, timeout=30) as py:
        got = compare_rows(cpp_bin, srv.target, py, ["too_long", "kv_exhausted"])
        assert got["too_long"][:2] == ["OUT_OF_RANGE", "SEQUENCE_TOO_LONG"]
        assert got["kv_exhausted"] == ["RESOURCE_EXHAUSTED", "KV_CAPACITY_EXHAUSTED", "retryable"]
        srv.app.servicer.gate.state = ServerState.DRAINING  # the flag SIGTERM's drain sets
        try:
            want = outcome(lambda: py.prefill([1, 2, 3]))
            refused = run(cpp_bin, "ferrum-generate", "--target", srv.target, "--tokens", "1,2,3", check=False)
        finally:
            srv.app.servicer.gate.state = ServerState.SERVING
        assert want == ["UNAVAILABLE", "DRAINING"]
        assert refused.returncode == 2 and "ferrum-generate: DRAINING: " in refused.stderr


# -- a decode-ahead run cancelled or stopped mid-way -------------------------------------
class _Abandon(Exception):
    pass


def test_cancelled_decode_ahead_leaves_the_sequence_as_pythons_does(cpp_bin, server, py):
    pre = py.prefill(PROMPT, logits=ARGMAX)
    seen: list[int] = []

    def on_token(chosen):
        seen.append(chosen.token_id)
        if len(seen) >= 3:
            raise _Abandon

    with pytest.raises(_Abandon):
        py.decode_ahead(int(pre.logits.token_ids[0][0]), pre.kv_cache, SEEDED, 200, on_token=on_token)
    step = py.decode(5, pre.kv_cache, logits=ARGMAX)  # the run was undone: the old handle is current
    py.release_cache(step.kv_cache)
    got = lines(run(cpp_bin, "ferrum-cpp-check", "cancel", "--target", server.target, "--tokens", ids(PROMPT),
                    "--after", 3).stdout)
    assert got["cancelled"] == ["3"]
    assert got["length"] == [str(pre.kv_cache.sequence_length)]
    assert got["after"] == [str(step.kv_cache.sequence_length), str(int(step.logits.token_ids[0][0]))]


def test_stopped_decode_ahead_ends_where_its_handle_says(cpp_bin, server, py):
    got = lines(run(cpp_bin, "ferrum-cpp-check", "stop", "--target", server.target, "--tokens", ids(PROMPT),
                    "--after", 3).stdout)
    reason, emitted = got["finish"][0], int(got["finish"][1])
    assert reason == "stopped" and emitted >= 3
    assert int(got["length"][0]) == len(PROMPT) + emitted  # the token passed in + all chosen but the last
    assert int(got["after"][0]) == len(PROMPT) + emitted + 1


# -- a caller-named prefill: retried, never released by the client ---------------------
def test_a_caller_named_prefill_is_retried_not_released(cpp_bin, server, py):
    """The first call times out before it is sent; the client leaves the caller's name
    alone, so the retry makes the sequence, and a second retry gets it back (its reply
    as if lost) as an existing sequence without logits; another prompt under the name is
    REQUEST_ID_TAKEN, and nothing is left once the caller releases the name."""
    kv = server.app.servicer.gate.workers["tiny"].executor.kv
    before = kv.count("")
    got = lines(run(cpp_bin, "ferrum-cpp-check", "names", "--target", server.target, "--tokens", ids(PROMPT),
                    "--name", "cpp-retry-1").stdout)
    assert got["timed_out"][:2] == ["DEADLINE_EXCEEDED", "-"]
    assert got["retry"] == ["OK", f"0:{len(PROMPT)}"]
    assert got["again"] == ["OK", f"1:1:{len(PROMPT)}:0"]
    assert got["other_prompt"][:2] == ["ALREADY_EXISTS", "REQUEST_ID_TAKEN"]
    assert got["release"][0] == "OK"
    assert kv.count("") == before and kv.names.named("", "cpp-retry-1") is None


# -- TLS with a bearer token -------------------------------------------------------------
def test_tls_with_a_token(cpp_bin, tiny_llama_dir, pki, tokens_file):  # noqa: F811
    kwargs = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"), auth_tokens=tokens_file)
    with running_server(tiny_llama_dir, server_kwargs=kwargs) as srv, \
            ExecutorClient(srv.target, timeout=30, tls=ClientTls(ca=str(pki / "ca.pem"), server_name="localhost"),
                           token=ALICE) as py:
        want = python_seeded(py, 12)
        tls = ["--ca", pki / "ca.pem", "--server-name", "localhost"]
        assert generate(cpp_bin, srv.target, 12, (), *tls, "--token", ALICE) == want
        refused = run(cpp_bin, "ferrum-generate", "--target", srv.target, "--info", *tls, check=False)
        assert refused.returncode == 2 and "UNAUTHENTICATED: " in refused.stderr
        bad = run(cpp_bin, "ferrum-generate", "--target", srv.target, "--info", *tls, "--token", "nobody-" + "x" * 20,
                  check=False)
        assert bad.returncode == 2 and "UNAUTHENTICATED: " in bad.stderr


# -- every RPC of the contract through the typed C++ API ---------------------------------
RPC_ANSWERS = {
    "GetModelInfo": "OK llama:", "GetCapabilities": "OK", "GetStatus": "OK serving", "Prefill": "OK", "Decode": "OK",
    "BatchDecode": "OK", "ForwardVerify": "OK", "TruncateKv": "OK", "ReleaseCache": "OK", "DecodeSession": "OK",
    "ForkCache": "OK", "Forward": "UNIMPLEMENTED", "SpeculativeDecode": "OK", "BatchPrefill": "OK",
    "ListModels": "OK", "LoadModel": "OK", "UnloadModel": "OK", "RegisterSharedMemory": "OK",
    "UnregisterSharedMemory": "OK 1", "ExportSequence": "OK", "ImportSequence": "OK 1", "CreateImportTicket": "OK",
    "PushSequence": "OK 1", "WatchKvEvents": "OK 1:1", "LoadAdapter": "OK 8", "ListAdapters": "OK 1",
    "UnloadAdapter": "OK", "UpdateWeights": "OK 1",
}


@pytest.fixture(scope="module")
def rpc_lines(cpp_bin, server, tiny_llama_dir, tmp_path_factory) -> dict:
    """Every RPC once; UpdateWeights with the model's own tensors (the same weights: the
    module's other tests see the same logits), LoadAdapter with an adapter made by peft."""
    from ferrum_rpc.hashing import stream_hasher
    from tests.component.models.lora_helpers import make_adapter

    folder = tmp_path_factory.mktemp("cpp-update")
    adapter = make_adapter(tiny_llama_dir, folder / "adapter", seed=3, r=8)
    update = (tiny_llama_dir / "model.safetensors").read_bytes()
    checksum = stream_hasher()
    checksum.update(update)
    (folder / "update.safetensors").write_bytes(update)
    return lines(run(cpp_bin, "ferrum-cpp-check", "rpcs", "--target", server.target, "--load-dir",
                     tiny_llama_dir, "--adapter-dir", adapter, "--update-file", folder / "update.safetensors",
                     "--update-checksum", checksum.hexdigest()).stdout)


def test_the_table_names_every_rpc_of_the_contract():
    from ferrum_rpc.v1 import executor_pb2 as pb

    assert set(RPC_ANSWERS) == set(pb.DESCRIPTOR.services_by_name["ModelExecutor"].methods_by_name)


@pytest.mark.parametrize("rpc", sorted(RPC_ANSWERS))
def test_rpc_through_the_typed_cpp_api(rpc_lines, rpc):
    assert rpc in rpc_lines, f"ferrum-cpp-check did not call {rpc}"
    assert " ".join(rpc_lines[rpc]).startswith(RPC_ANSWERS[rpc]), rpc_lines[rpc]


def test_example_prints_capabilities_and_status(cpp_bin, server):
    done = run(cpp_bin, "ferrum-generate", "--target", server.target, "--info")
    assert "GetCapabilities:" in done.stderr and "max_decode_ahead" in done.stderr
    assert "GetStatus:" in done.stderr and "state:" in done.stderr
