"""`pip install ferrum-rpc` gives the client alone: a fresh virtual environment with
no torch, transformers or grpcio-tools drives a live server over real gRPC and
gets the tokens the full install gets; server commands say which extra they need."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from tests.conftest import running_server

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "safetensors", "gguf", "accelerate", "grpcio-tools", "prometheus-client")


def _pip(venv: Path, *args: str, **kwargs) -> subprocess.CompletedProcess:
    """This environment's pip acting on ``venv`` (which has no pip of its own)."""
    return subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *args],
                          capture_output=True, text=True, **kwargs)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    """A fresh environment with the project's wheel installed, as a registry user gets
    it.  The wheel is built here, with this environment's setuptools, and installed by
    this environment's pip: the same files and dependencies as the new environment
    building and installing it itself, without its own pip and build environment."""
    where = tmp_path_factory.mktemp("client-only")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                            "--wheel-dir", str(where / "dist"), str(ROOT)], capture_output=True, text=True,
                           timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (where / "dist").glob("ferrum_rpc-*.whl")
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    done = _pip(venv, "install", "--quiet", "--constraint", str(ROOT / "constraints.txt"), str(wheel), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return venv


def test_the_client_install_is_light(client_venv):
    listed = _pip(client_venv, "list", "--format=json", check=True)
    names = {p["name"].lower() for p in json.loads(listed.stdout)}
    assert {"ferrum-rpc", "grpcio", "grpcio-status", "protobuf", "numpy"} <= names
    assert not names & set(HEAVY), names & set(HEAVY)


def test_a_client_only_install_generates_against_a_live_server(client_venv, tiny_llama_dir):
    script = textwrap.dedent("""
        import importlib.util, json, sys
        assert importlib.util.find_spec("torch") is None, "torch must not be importable here"
        from ferrum_rpc.client import ExecutorClient, LogitsPolicy
        greedy = LogitsPolicy.argmax()
        with ExecutorClient(sys.argv[1], timeout=30) as ex:
            out = ex.prefill([5, 9, 13, 2], logits=greedy)
            tokens, handle = [out.logits.argmax()[0]], out.kv_cache
            while len(tokens) < 12:
                step = ex.decode(tokens[-1], handle, greedy)
                tokens.append(step.logits.argmax()[0]); handle = step.kv_cache
            full = ex.decode(tokens[-1], handle).logits.values  # full float32 rows: numpy only
            ex.release_cache(handle)
        print(json.dumps({"tokens": tokens, "row": full[0].tolist(),
                          "server_modules": sorted(m for m in sys.modules if m.startswith("ferrum_rpc.server"))}))
    """)
    with running_server(tiny_llama_dir) as server, ExecutorClient(server.target, timeout=30) as ex:
        done = subprocess.run([str(client_venv / "bin" / "python"), "-c", script, server.target],
                              capture_output=True, text=True, timeout=120, cwd="/")
        assert done.returncode == 0, done.stderr[-3000:]
        got = json.loads(done.stdout)
        out = ex.prefill([5, 9, 13, 2], logits=LogitsPolicy.argmax())
        tokens, handle = [out.logits.argmax()[0]], out.kv_cache
        while len(tokens) < 12:
            step = ex.decode(tokens[-1], handle, LogitsPolicy.argmax())
            tokens.append(step.logits.argmax()[0])
            handle = step.kv_cache
        row = ex.decode(tokens[-1], handle).logits.values[0]
        ex.release_cache(handle)
    assert got["tokens"] == tokens
    assert got["row"] == row.tolist()  # bit for bit
    assert got["server_modules"] == []


def test_server_commands_name_the_extra_they_need(client_venv, tmp_path):
    """Named before anything else runs: with an empty FERRUM_RPC_HOME (a fresh machine, the
    embedded model never prepared) ``serve`` names its extra, not the model it cannot prepare."""
    cli = str(client_venv / "bin" / "ferrum-rpc")
    env = {**os.environ, "FERRUM_RPC_HOME": str(tmp_path / "home")}
    assert subprocess.run([cli, "--help"], capture_output=True, text=True, env=env, timeout=60).returncode == 0
    for command, extra in ((["serve", "--port", "0"], "server"), (["prepare"], "server,text"),
                           (["generate", "hello"], "text")):
        done = subprocess.run([cli, *command], capture_output=True, text=True, env=env, timeout=60)
        assert done.returncode == 2, (command, done.stderr[-3000:])
        assert f"is not installed; pip install 'ferrum-rpc[{extra}]'" in done.stderr, done.stderr[-3000:]
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr[-3000:]
    assert not (tmp_path / "home").exists()  # nothing prepared, nothing written
