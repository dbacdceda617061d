"""A model folder's weights digest (the KV fingerprint's) is hashed once and read back on
later starts while none of its files changed; any change to a file is hashed again."""

from __future__ import annotations

import shutil

import pytest

from ferrum_rpc import hashing
from ferrum_rpc.server.engine import weights

pytestmark = pytest.mark.timeout(120)


def test_the_digest_is_stored_and_hashed_again_when_a_file_changes(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("FERRUM_RPC_HOME", str(tmp_path / "home"))
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, folder)
    first = weights.stored_weights_digest(folder)
    assert first == hashing.weights_digest(folder)
    hashed = []
    monkeypatch.setattr(weights, "weights_digest", lambda path: hashed.append(path) or hashing.weights_digest(path))
    assert weights.stored_weights_digest(folder) == first and hashed == []  # read back, not hashed
    with open(folder / "model.safetensors", "r+b") as f:  # one byte of a tensor changes, the size does not
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    changed = weights.stored_weights_digest(folder)
    assert len(hashed) == 1 and changed == hashing.weights_digest(folder) != first
