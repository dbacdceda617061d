"""The system tier: real servers (in-process on port 0, or ``ferrum-rpc serve``
processes), real ranks and replicas, tiny random models and the real SmolLM2.
Every test here is marked ``system`` (``pytest -m "not system"`` leaves them out)."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.system)
