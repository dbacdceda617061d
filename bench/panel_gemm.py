"""GFLOP/s of the batch-invariant panel GEMM (csrc/panel_gemm.cpp) against oneDNN's
packed linear (the default kernels' path) and linear_rows_tiled (the invariant
mode's kernel before it), on SmolLM2-135M's linear shapes, side by side: each
round times the three in turn, the figure is the median over rounds.

    python -m bench.panel_gemm [--rows 1,32,512] [--dtypes float32,bfloat16] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from bench.common import write_results
from ferrum_rpc.server.kernels.build import load_library

log = logging.getLogger("bench.panel_gemm")
SHAPES = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]  # (K, N)


def _seconds(fn, budget: float = 0.05) -> float:
    fn()
    runs, start = 0, time.perf_counter()
    while True:
        fn()
        runs += 1
        took = time.perf_counter() - start
        if took > budget and runs >= 2:
            return took / runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32,512")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--name", default="panel_gemm")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    load_library()
    ops, mk = torch.ops.ferrum_fused, torch.ops.mkldnn
    gen = torch.Generator().manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    results = []
    for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
        for k, n in SHAPES:
            w = torch.randn(n, k, generator=gen).to(dtype)
            panels, packed = ops.pack_panels(w), mk._reorder_linear_weight(w)
            for m in rows:
                x = torch.randn(m, k, generator=gen).to(dtype)
                kernels = {"panel": lambda: ops.panel_linear(x, panels, n),
                           "onednn": lambda: mk._linear_pointwise(x, packed, None, "none", [], ""),
                           "tiled": lambda: ops.linear_rows_tiled(x, w)}
                times: dict[str, list[float]] = {name: [] for name in kernels}
                for _ in range(args.rounds):
                    for name, fn in kernels.items():
                        times[name].append(_seconds(fn))
                flops = 2 * m * k * n
                row = {"dtype": str(dtype)[6:], "K": k, "N": n, "rows": m}
                row |= {f"{name}_gflops": round(flops / statistics.median(t) / 1e9, 1) for name, t in times.items()}
                results.append(row)
                log.info("%-8s %5d -> %5d rows %3d: panel %6.1f  oneDNN %6.1f  tiled %6.1f GFLOP/s", row["dtype"], k,
                         n, m, row["panel_gflops"], row["onednn_gflops"], row["tiled_gflops"])
    write_results(args.name, results, {"rounds": args.rounds})


if __name__ == "__main__":
    main()
