"""Server classes are composed, not mixed: no class under server/ inherits from two
classes, and one server class inherits from another only where both are torch modules
(a model family's layer specialising the Llama one, a quantized linear specialising
another).  A class's methods therefore live in one file."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]
SERVER = ROOT / "server"
CLIENT = ROOT / "client"
MODULE_ROOTS = {"nn.Module", "torch.nn.Module", "Module"}


def _classes(folder: Path = SERVER) -> dict[str, tuple[str, list[str]]]:
    found: dict[str, tuple[str, list[str]]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                found[node.name] = (str(path.relative_to(folder)), [ast.unparse(b) for b in node.bases])
    return found


def _root(name: str, classes: dict) -> str:
    """The first base outside server/ up ``name``'s chain of server bases."""
    seen = set()
    while name in classes and name not in seen:
        seen.add(name)
        bases = classes[name][1]
        if not bases:
            return "object"
        name = bases[0].split(".")[-1] if bases[0].split(".")[-1] in classes else bases[0]
    return name


def test_no_class_mixes_server_classes():
    classes = _classes()
    wrong = []
    for name, (path, bases) in classes.items():
        local = [b for b in bases if b.split(".")[-1] in classes]
        if len(bases) > 1 and local:
            wrong.append(f"{path}: {name}({', '.join(bases)}) inherits from more than one class")
        elif local and _root(name, classes) not in MODULE_ROOTS:
            wrong.append(f"{path}: {name}({local[0]}) inherits a server class that is no torch module (compose it)")
    assert not wrong, "\n".join(wrong)


def test_no_client_class_inherits_across_files():
    """The client's classes too: a twin (blocking, asyncio) may share a base in its own
    file; one that inherits a class of another file (a mixin, a driver) is composed instead."""
    classes = _classes(CLIENT)
    wrong = [f"{path}: {name}({', '.join(bases)})" for name, (path, bases) in classes.items()
             for base in bases if base.split(".")[-1] in classes and classes[base.split(".")[-1]][0] != path]
    assert not wrong, "\n".join(wrong)


def test_the_rule_sees_a_mixin():
    """The check itself: a class mixing a plain server class in is caught."""
    classes = {"Parts": ("a.py", []), "Worker": ("b.py", ["Parts"])}
    assert _root("Worker", classes) == "object"


def test_no_server_file_is_over_400_lines():
    """One concept a file: a file that grows past 400 lines holds two."""
    long = {str(p.relative_to(SERVER)): n for p in SERVER.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long
