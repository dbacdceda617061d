"""The unit tier: no process, no socket, no compiled kernel, no model file.

Each unit test runs with those four refused (an AssertionError naming what it tried),
so the tier stays what ``make test-fast`` promises: seconds, on any fresh machine.
Tests that need built kernels or a model's files are in tests/component; tests that
start servers or processes are in tests/system and tests/contract."""

from __future__ import annotations

import socket
import subprocess

import pytest


def _refused(what: str):
    def refuse(*args, **kwargs):
        raise AssertionError(f"a unit test {what}: it belongs in tests/component, tests/system or tests/contract")
    return refuse


@pytest.fixture(autouse=True)
def _unit_tier(monkeypatch):
    monkeypatch.setattr(subprocess.Popen, "__init__", _refused("started a process"))
    for name in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, name, _refused("opened a socket"))
    from ferrum_rpc.server.kernels import build

    monkeypatch.setattr(build, "build_extension", _refused("built or loaded the C++ kernels"))


def _no_model_files():
    raise AssertionError("a unit test asked for a model's files: it belongs in tests/component or tests/system")


tiny_llama_dir = pytest.fixture(_no_model_files, name="tiny_llama_dir")
default_model_dir = pytest.fixture(_no_model_files, name="default_model_dir")
