"""Node.js and the clients/node packages (grpc-js, proto-loader, google-proto-files,
@bufbuild/buf) for the tests that need them: installed on first use with ``npm
install --no-save`` (exact versions pinned in package.json and the committed
lockfile; ``npm ci`` refuses lockfiles made where npm is set to omit other
platforms' optional packages, as buf's binaries are); tests skip, saying why,
only where node or npm is absent."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

NODE_DIR = Path(__file__).resolve().parent.parent / "clients" / "node"
BUF = NODE_DIR / "node_modules" / ".bin" / "buf"


def node_packages() -> Path:
    """The clients/node folder with its node_modules installed (or the test is skipped)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("node/npm are not installed: the Node.js client and buf checks need them")
    if not (NODE_DIR / "node_modules" / "@grpc" / "grpc-js").exists() or not BUF.exists():
        done = subprocess.run(["npm", "install", "--no-save", "--no-audit", "--no-fund"], cwd=NODE_DIR,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"npm install failed:\n{done.stderr[-3000:]}"
    return NODE_DIR
