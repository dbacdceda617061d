"""One linear layer at SmolLM2-135M's shapes, 1 / 8 / 32 activation rows, ms
(best of N): float32 (``F.linear``, oneDNN packed, and for 1-4 rows our
``linear_rows`` GEMV from ``csrc/linear_rows.cpp``; the LM head, 113 MB, is read from
memory every call, the other layers fit the caches), our weight-only int8
and int4 (``woq.py``), torch's fbgemm dynamic int8 linear (int8 weights per
channel, activations per call), and our integer-activation kernels (w8a8,
w4a8, ``qact.py``).  The evidence behind ``qact.py``'s choice of kernel.

    python -m bench.quant_linears [--rows 1 8 32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

from ferrum_rpc.server.kernels import qact
from ferrum_rpc.server.kernels import woq
from ferrum_rpc.server.models.linear import LINEAR_ROWS_MAX

SHAPES = {"lm_head": (49152, 576), "qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def best_ms(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * min(times)  # the least disturbed run: this host is shared


def fbgemm_dynamic(weight: torch.Tensor):
    """torch.ops.quantized's dynamic linear over int8 per-channel weights (x86 engine)."""
    scales = weight.abs().amax(dim=1) / 127
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensor creation is deprecated, the op is not
        q = torch.quantize_per_channel(weight, scales.double(), torch.zeros(len(weight), dtype=torch.long), 0,
                                       torch.qint8)
    packed = torch.ops.quantized.linear_prepack(q, None)
    return lambda x: torch.ops.quantized.linear_dynamic(x, packed, True)


def rotated_w8a8(weight: torch.Tensor) -> qact.RotatedQ8Linear:
    """What w8a8 runs on a GGUF's projections: the weights on a Q4_1 grid (16 levels a
    block, as the embedded model's), so they rotate (``qact.rotate_codes``)."""
    grid = woq.QuantizedLinear(weight, None, 4, woq.DEQUANT).dequantized()
    layer = qact.RotatedQ8Linear(grid, None, 8, qact.QACT)
    assert layer.rotated
    return layer


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    woq.load_library()
    print(f"{'layer':8} {'rows':>4} {'f32':>8} {'f32 pk':>8} {'f32 rows':>8} {'int8':>8} {'int4':>8} {'fbgemm':>8} "
          f"{'w8a8':>8} {'w4a8':>8}   (ms, best of {args.repeats}, {torch.get_num_threads()} threads)")
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=torch.Generator().manual_seed(0)) * 0.05
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        layers = {
            "f32": lambda x: F.linear(x, weight),
            "f32 pk": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
            "f32 rows": lambda x: torch.ops.ferrum_fused.linear_rows(x, weight),
            "int8": woq.QuantizedLinear(weight, None, 8, woq.WOQ),
            "int4": woq.QuantizedLinear(weight, None, 4, woq.WOQ),
            "fbgemm": fbgemm_dynamic(weight),
            "w8a8": rotated_w8a8(weight),
            "w4a8": qact.BlockQ8Linear(weight, None, 4, qact.QACT),
        }
        for rows in args.rows:
            x = torch.randn(rows, k)
            print(f"{name:8} {rows:4d} " + " ".join(  # linear_rows takes up to LINEAR_ROWS_MAX rows
                f"{'-':>8}" if kind == "f32 rows" and rows > LINEAR_ROWS_MAX
                else f"{best_ms(lambda: f(x), args.repeats):8.3f}" for kind, f in layers.items()), flush=True)


if __name__ == "__main__":
    main()
