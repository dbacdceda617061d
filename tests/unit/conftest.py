"""Fixtures the unit tier's kernel tests share."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(params=["avx512", "avx2", "portable"])
def isa(request, ops):
    """The C++ kernels capped at each inner-loop path (woq.cpp's cap binds every file),
    skipped where this CPU cannot run it; ``ops``: the requesting module's built kernels.
    Modules with a cap of their own (test_qact, test_woq) define ``isa`` themselves."""
    ran = torch.ops.ferrum_woq.set_max_isa(request.param)
    if ran != request.param:
        torch.ops.ferrum_woq.set_max_isa("avx512")
        pytest.skip(f"this CPU cannot run the {request.param} path")
    yield request.param
    torch.ops.ferrum_woq.set_max_isa("avx512")
