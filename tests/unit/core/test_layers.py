"""The server's rooms keep a strict order, read from every module's imports (function-local
and ``if TYPE_CHECKING:`` ones included: an annotation is a dependency too):
cli -> app -> rank -> registry -> preflight -> prepare -> rpc -> engine -> parallel ->
models -> kernels -> choice -> kv -> config.  A room imports only rooms below it; rpc
enters the engine through ``engine/facade.py`` alone.  No import cycle under server/
or client/.  No module of rpc/ imports torch itself (tests/system/test_import_weight.py
imports the torch-free modules in a process of their own)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
SERVER = ROOT / "server"
CLIENT = ROOT / "client"
ORDER = ["cli", "app", "rank", "registry", "preflight", "prepare", "rpc", "engine", "parallel", "models",
         "kernels", "choice", "kv", "config", "__init__"]
RANK = {room: len(ORDER) - i for i, room in enumerate(ORDER)}


def _room(module: str) -> str:
    parts = module.split(".")  # ferrum_rpc.server.<room>...
    return parts[2] if len(parts) > 2 else "__init__"


def _module(path: Path, folder: Path = SERVER, package: str = "ferrum_rpc.server") -> str:
    parts = list(path.relative_to(folder).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([package, *parts])


def _imports(path: Path, folder: Path, package: str, known: set[str]):
    """(line, module) of every import of a module in ``known``: ``from a import b`` names
    a.b where that is a module, else a."""
    here = _module(path, folder, package).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                target = f"{module}.{alias.name}"
                yield node.lineno, target if target in known else module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)


def _graph(folder: Path, package: str) -> dict[str, set[str]]:
    modules = {_module(p, folder, package): p for p in folder.rglob("*.py")}
    edges = defaultdict(set)
    for name, path in modules.items():
        for _, target in _imports(path, folder, package, set(modules)):
            if target in modules and target != name:
                edges[name].add(target)
    return {m: edges[m] for m in modules}


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _server_edges():
    modules = {_module(p) for p in SERVER.rglob("*.py")}
    for path in sorted(SERVER.rglob("*.py")):
        for line, target in _imports(path, SERVER, "ferrum_rpc.server", modules):
            if target.startswith("ferrum_rpc.server"):
                yield path, line, _module(path), target


def test_the_order_is_strict():
    assert len(set(RANK.values())) == len(RANK)


def test_imports_point_down():
    wrong = [f"server/{path.relative_to(SERVER)}:{line} ({_room(mine)}) imports {target}"
             for path, line, mine, target in _server_edges()
             if _room(target) != _room(mine) and RANK[_room(target)] > RANK[_room(mine)]]
    assert wrong == []


def test_rpc_enters_the_engine_through_its_facade_alone():
    wrong = [f"server/{path.relative_to(SERVER)}:{line} imports {target}"
             for path, line, mine, target in _server_edges()
             if _room(mine) == "rpc" and _room(target) not in ("rpc", "config")
             and target != "ferrum_rpc.server.engine.facade"]
    assert wrong == []


@pytest.mark.parametrize("folder,package", [(SERVER, "ferrum_rpc.server"), (CLIENT, "ferrum_rpc.client")])
def test_no_import_cycles(folder, package):
    assert _cycles(_graph(folder, package)) == []


def test_the_cycle_check_sees_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_server_imports_are_relative():
    absolute = [f"server/{p.relative_to(SERVER)}" for p in SERVER.rglob("*.py")
                if "from ferrum_rpc.server" in p.read_text() or "import ferrum_rpc.server" in p.read_text()]
    assert absolute == []


def test_no_module_of_rpc_imports_torch_itself():
    direct = [f"server/rpc/{p.name}" for p in (SERVER / "rpc").glob("*.py")
              if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "torch" in
                     ([a.name.split(".")[0] for a in n.names] if isinstance(n, ast.Import) else [(n.module or "").split(".")[0]])
                     for n in ast.walk(ast.parse(p.read_text())))]
    assert direct == []
