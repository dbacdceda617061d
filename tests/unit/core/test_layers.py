"""The server's rooms keep their direction: rpc -> engine -> kv / choice / parallel /
kernels -> models, read from every module's imports (function-local ones included;
imports under ``if TYPE_CHECKING:`` are annotations, not dependencies).  The process
modules at the top (app, cli, rank, registry, prepare, preflight) may use any room; config is
read by all.  rpc/ and the block manager import no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

SERVER = Path(__file__).resolve().parents[3] / "server"
RANK = {"app": 5, "cli": 5, "rank": 5, "registry": 5, "prepare": 5, "preflight": 5,
        "rpc": 4, "engine": 3, "choice": 2, "parallel": 2, "models": 1, "kernels": 1, "kv": 0,
        "config": -1, "__init__": -1}


def _room(module: str) -> str:
    parts = module.split(".")  # ferrum_rpc.server.<room>...
    return parts[2] if len(parts) > 2 else "__init__"


def _type_only(tree: ast.AST) -> set[int]:
    """ids of the import nodes under ``if TYPE_CHECKING:``."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            skip.update(id(n) for n in ast.walk(node))
    return skip


def _server_imports(path: Path):
    package = ["ferrum_rpc", "server", *path.relative_to(SERVER).parts[:-1]]
    tree = ast.parse(path.read_text())
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            if module == "ferrum_rpc.server":
                yield from ((node.lineno, f"{module}.{a.name}") for a in node.names)
            elif module.startswith("ferrum_rpc.server."):
                yield node.lineno, module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names if a.name.startswith("ferrum_rpc.server"))


def _module(path: Path) -> str:
    return ".".join(["ferrum_rpc", "server", *path.relative_to(SERVER).with_suffix("").parts])


def test_imports_point_down():
    upward = []
    for path in sorted(SERVER.rglob("*.py")):
        mine = _room(_module(path))
        for line, target in _server_imports(path):
            if RANK[_room(target)] > RANK[mine]:
                upward.append(f"server/{path.relative_to(SERVER)}:{line} ({mine}) imports {target}")
    assert upward == []


def test_server_imports_are_relative():
    absolute = [f"server/{p.relative_to(SERVER)}" for p in SERVER.rglob("*.py")
                if "from ferrum_rpc.server" in p.read_text() or "import ferrum_rpc.server" in p.read_text()]
    assert absolute == []


@pytest.mark.parametrize("module", ["ferrum_rpc.server.rpc.auth", "ferrum_rpc.server.rpc.ledger",
                                    "ferrum_rpc.server.kv.blocks", "ferrum_rpc.server.engine.scheduler"])
def test_torch_free_modules_import_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_no_module_of_rpc_imports_torch_itself():
    direct = [f"server/rpc/{p.name}" for p in (SERVER / "rpc").glob("*.py")
              if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in
                     ([a.name.split(".")[0] for a in n.names] if isinstance(n, ast.Import) else [(n.module or "").split(".")[0]])
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert direct == []
