"""The contract as other languages see it: buf lint (STANDARD + COMMENTS, with the
exceptions buf.yaml states) and buf breaking (WIRE_JSON) against the released
v0.1.0 contract, both run here from the @bufbuild/buf npm package."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.node_env import BUF, node_packages

ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("protos") / "ferrum_rpc" / "v1" / "executor.proto"
RELEASED = ROOT / "protos" / "released" / "ferrum-executor-v0.1.0.binpb"
GOOGLE = Path("clients") / "node" / "node_modules" / "google-proto-files"


def _buf(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUF), *args], cwd=root, capture_output=True, text=True, timeout=300)


def _workspace(tmp_path: Path, edit: tuple[str, str] | None = None) -> Path:
    """The repository's buf workspace, or a copy whose contract has one edit (old, new)."""
    node_packages()
    if edit is None:
        return ROOT
    text = (ROOT / PROTO).read_text()
    assert edit[0] in text
    (tmp_path / PROTO).parent.mkdir(parents=True)
    (tmp_path / PROTO).write_text(text.replace(edit[0], edit[1]))
    (tmp_path / "buf.yaml").write_text((ROOT / "buf.yaml").read_text())
    (tmp_path / GOOGLE).parent.mkdir(parents=True)
    (tmp_path / GOOGLE).symlink_to(ROOT / GOOGLE)
    return tmp_path


def _breaking(root: Path) -> subprocess.CompletedProcess:
    built = _buf(root, "build", "--path", "protos/ferrum_rpc", "-o", "current.binpb")
    assert built.returncode == 0, built.stderr
    try:
        return _buf(root, "breaking", "current.binpb", "--against", str(RELEASED), "--config", "buf.yaml")
    finally:
        (root / "current.binpb").unlink()


def test_buf_lint_passes(tmp_path):
    done = _buf(_workspace(tmp_path), "lint", "--path", "protos/ferrum_rpc")
    assert done.returncode == 0, done.stdout + done.stderr


def test_buf_lint_catches_an_undocumented_field(tmp_path):
    """The rule set bites: the same file with one field comment removed fails."""
    root = _workspace(tmp_path, ("  // Rows in this reply (for every kind).\n", ""))
    done = _buf(root, "lint", "--path", "protos/ferrum_rpc")
    assert done.returncode != 0 and 'Field "positions" should have a non-empty comment' in done.stdout


def test_buf_breaking_against_the_released_contract(tmp_path):
    done = _breaking(_workspace(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr


def test_buf_breaking_bites(tmp_path):
    """A wire change (a field's type) against the released contract is refused."""
    done = _breaking(_workspace(tmp_path, ("  uint32 top_k = 3;", "  uint64 top_k = 3;")))
    assert done.returncode != 0 and 'changed type from "uint32" to "uint64"' in done.stdout
