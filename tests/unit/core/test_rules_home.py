"""The request rules have one home (``ferrum_rpc/rules``): the server refuses a
request's shape only through them, and the Python client checks what it sends with
the same functions.  What stays in the server reads state a client cannot see; each
such file is listed here with why."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from ferrum_rpc.rules import requests

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]

# server files that may raise InvalidInput themselves: each checks against state
STATEFUL = {
    "server/engine/checks.py": "a sequence in the middle of a chunked prefill (its pins)",
    "server/engine/sequences.py": "a truncation past the sequence's own length",
    "server/engine/transfer.py": "an import stream against its own header, this server's fingerprint and KV size",
    "server/engine/weights_file.py": "an update's tensors against the model's",
    "server/registry.py": "a model name already hosted, a folder on the server's disk",
    "server/rpc/edge.py": "a request lacking its handle, read where the call enters",
    "server/rpc/handler.py": "a message protobuf could not parse",
    "server/rpc/migration.py": "an import stream's order",
    "server/rpc/session.py": "a decode-ahead step id still running on this stream",
    "server/rpc/shm.py": "a region against the registered one (its name taken, its size, its object)",
    "server/rpc/weights.py": "an update stream's order and this model's size",
}
# rules the Python client has no occasion to apply, and why
SERVER_ONLY = {
    "check_release": "the client's release_cache takes a handle or a request_id by its signature",
}


def _raisers(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call)
               and getattr(node.func, "id", getattr(node.func, "attr", None)) == "InvalidInput")


@functools.cache
def _called(folder: str) -> frozenset[str]:
    """The names of every function called under ``folder``."""
    return frozenset(getattr(node.func, "id", getattr(node.func, "attr", None))
                     for path in (ROOT / folder).rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
                     if isinstance(node, ast.Call))


def _callers(name: str, folder: str) -> bool:
    return name in _called(folder)


def test_the_server_refuses_a_request_shape_only_through_the_rules():
    stray = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "server").rglob("*.py"))
             if (n := _raisers(p)) and str(p.relative_to(ROOT)) not in STATEFUL}
    assert not stray, f"InvalidInput raised outside ferrum_rpc/rules and the stateful checks: {stray}"
    gone = [f for f in STATEFUL if not (ROOT / f).exists() or not _raisers(ROOT / f)]
    assert not gone, f"listed as stateful but raising nothing (drop them): {gone}"


def _applied(folder: str, rules: list[str]) -> set[str]:
    """The rules code under ``folder`` calls, and those the called rules call."""
    inner = {}
    for node in ast.parse(Path(requests.__file__).read_text()).body:
        if isinstance(node, ast.FunctionDef):
            inner[node.name] = {getattr(c.func, "id", None) for c in ast.walk(node) if isinstance(c, ast.Call)}
    applied = {name for name in rules if _callers(name, folder)}
    while grown := {r for name in applied for r in inner.get(name, ()) if r in rules} - applied:
        applied |= grown
    return applied


def test_each_rule_is_applied_by_the_server_and_the_client():
    rules = [n for n in dir(requests) if n.startswith("check_")]
    assert len(rules) >= 15
    server, client = _applied("server", rules), _applied("client", rules)
    assert not set(rules) - server, f"rules the server never applies: {sorted(set(rules) - server)}"
    missing = set(rules) - client - set(SERVER_ONLY)
    assert not missing, f"rules the Python client never applies (or say why in SERVER_ONLY): {sorted(missing)}"
