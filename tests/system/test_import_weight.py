"""What the torch-free modules pull in, each imported in a fresh process: the rpc layer's
torch-free modules, the block manager and the scheduling policy import no torch, so their
unit tests and any caller of them stay light."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("module", ["ferrum_rpc.server.rpc.auth", "ferrum_rpc.server.rpc.ledger",
                                    "ferrum_rpc.server.kv.blocks", "ferrum_rpc.server.engine.policy"])
def test_torch_free_modules_import_no_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, 'torch was imported'"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
