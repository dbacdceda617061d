"""Fixtures the component tier's kernel tests share."""

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


@pytest.fixture
def stack_cases():
    """The decode-stack tests' cases: ``stack_cases(model, shapes, seed, dtype, kv_dtype)``
    yields, for each (B, T) of ``shapes`` and layers [first, last) of (0, 2) and (1, 2),
    a namespace of x (B, T, C) in dtype, the step's (cos, sin, positions), a random pool
    (layers, 12 blocks of 4, kv heads, D) in kv_dtype (else dtype) shared by the cases,
    slots and tables (each
    sequence 3 random blocks, its positions inside them), and decode_layer's result over
    those layers (``want``) with the pool it wrote (``want_k``, ``want_v``)."""
    from types import SimpleNamespace

    def cases(model, shapes, seed, dtype=torch.float32, kv_dtype=None):
        layers, cfg, bs, blocks = model._whole_layer_args(), model.config, 4, 12
        gen = torch.Generator().manual_seed(seed)
        pool = [torch.randn(2, blocks, bs, cfg.num_kv_heads, cfg.head_dim, generator=gen).to(kv_dtype or dtype)
                for _ in range(2)]
        for B, T in shapes:
            x = torch.randn(B, T, cfg.hidden_size, generator=gen).to(dtype)
            tables = torch.stack([torch.randperm(blocks, generator=gen)[:3] for _ in range(B)])  # (B, 3)
            positions = torch.stack([torch.arange(T) + 2 + 3 * b % 7 for b in range(B)])  # (B, T), inside 3 blocks
            slots = (tables.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
            step = (model.rope_cos, model.rope_sin, positions)
            for first, last in [(0, 2), (1, 2)]:
                want_k, want_v, want = pool[0].clone(), pool[1].clone(), x
                for i in range(first, last):
                    want = torch.ops.ferrum_fused.decode_layer(
                        want, *layers[i], *step, want_k[i], want_v[i], slots, tables, cfg.num_heads,
                        cfg.num_kv_heads, 1 / cfg.head_dim ** 0.5)
                yield SimpleNamespace(B=B, T=T, first=first, last=last, x=x, step=step, pool=pool, slots=slots,
                                      tables=tables, want=want, want_k=want_k, want_v=want_v)

    return cases
