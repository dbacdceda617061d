"""Shared benchmark plumbing: a served model in a subprocess, timing, JSON output."""

from __future__ import annotations

import contextlib
import json
import logging
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from ferrum_rpc.harness import ServerProcess
from ferrum_rpc.server.config import QUANTIZATIONS

log = logging.getLogger("bench")
RESULTS = Path(__file__).resolve().parent / "results"
# served target -> the server process's resident memory at the end of its run,
# steady ("VmRSS") and peak ("VmHWM", loading included), MiB
RSS_MB: dict[str, dict[str, float]] = {}


def rss_mb(pid: int = 0) -> dict[str, float]:
    """A process's resident set now (VmRSS) and at its peak (VmHWM), MiB (0: this process)."""
    status = Path(f"/proc/{pid or 'self'}/status").read_text()
    return {key: int(re.search(rf"{key}:\s+(\d+)", status).group(1)) / 1024 for key in ("VmRSS", "VmHWM")}


def read_bandwidth_gbs(mib: int = 512, repeats: int = 5) -> float:
    """Memory read bandwidth as torch sees it (sum over a buffer far larger than the caches), GB/s.

    Measured in a child process: a torch op run here on the calling thread would give
    this process a second OpenMP thread team beside the model worker's, and libgomp,
    once it manages more threads than CPUs, stops spinning between parallel regions
    in every team (measured: the in-process w4a8 step 5.3 -> 12.4 ms on 2 cores)."""
    done = subprocess.run([sys.executable, "-c", "from bench.common import _read_bandwidth_here as f; "
                           f"print(f({mib}, {repeats}))"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return float(done.stdout.strip().splitlines()[-1])


def _read_bandwidth_here(mib: int, repeats: int) -> float:
    buf = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.numel() * 4 / best / 1e9


PEAK_SHAPES = ((256, 576, 3072), (512, 1536, 576), (1024, 1024, 1024))  # (M, K, N)


def compute_peak_gflops(dtype: str, repeats: int = 5) -> float:
    """The GEMM throughput torch reaches here in ``dtype`` (``F.linear`` of M x K by N x K,
    the best of :data:`PEAK_SHAPES`: the model's own and square ones), GFLOP/s; in a
    child process, as :func:`read_bandwidth_gbs` and for the same reason."""
    done = subprocess.run([sys.executable, "-c", "from bench.common import _compute_peak_here as f; "
                           f"print(f({dtype!r}, {repeats}))"], capture_output=True, text=True, check=True,
                          cwd=Path(__file__).resolve().parent.parent)
    return float(done.stdout.strip().splitlines()[-1])


def _compute_peak_here(dtype: str, repeats: int) -> float:
    best = 0.0
    for m, k, n in PEAK_SHAPES:
        x, w = torch.randn(m, k).to(getattr(torch, dtype)), torch.randn(n, k).to(getattr(torch, dtype))
        torch.nn.functional.linear(x, w)  # warm-up: the library picks and packs its kernel
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)
            fastest = min(fastest, time.perf_counter() - start)
        best = max(best, 2 * m * k * n / fastest / 1e9)
    return best


def kv_variant(name: str) -> tuple[str, str]:
    """A benchmark variant that may name the KV pool's dtype after it: ``w4a8+kv=float32``
    -> ("w4a8", "float32") (``--kv-dtype float32``); ``w4a8`` -> ("w4a8", "auto")."""
    base, _, kv_dtype = name.partition("+kv=")
    return base, kv_dtype or "auto"


def dtype_and_quantize(variant: str) -> tuple[str, str]:
    """A benchmark variant (a dtype or a ``--quantize`` mode) as ``serve``'s dtype and
    quantize mode: ``w4a8`` -> ("float32", "w4a8"), ``bfloat16`` -> ("bfloat16", "none")."""
    return ("float32", variant) if variant in QUANTIZATIONS else (variant, "none")


def server_errors(line: str) -> bool:
    """The server's stderr lines a benchmark shows (the rest is kept, not printed)."""
    return "ERROR" in line or "Traceback" in line


def bench_server(model_dir: str, dtype: str, kv_tokens: int, *extra: str) -> ServerProcess:
    """``ferrum-rpc serve`` of ``model_dir`` as "bench" in its own process (as deployed)."""
    return ServerProcess(f"bench={model_dir}", "--dtype", dtype, "--kv-tokens", str(kv_tokens), *extra,
                         echo=server_errors)


@contextlib.contextmanager
def served(model_dir: str, dtype: str, extra: tuple[str, ...] = (), kv_tokens: int = 32768):
    """``ferrum-rpc serve`` in its own process (as deployed); yields "host:port"."""
    with bench_server(model_dir, dtype, kv_tokens, *extra) as server:
        server.wait_serving(300)
        yield server.target
        RSS_MB[server.target] = rss_mb(server.pid)


def write_results(name: str, records: list[dict], meta: dict | None = None) -> Path:
    """``records`` and the run's facts (torch, threads, machine, time, and ``meta``) as JSON:
    ``bench/results/<name>.json``, or ``name`` itself where it is a path ending in .json."""
    path = Path(name) if name.endswith(".json") else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "threads": torch.get_num_threads(), "machine": platform.machine(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **(meta or {})}
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=2))
    log.info("wrote %s", path)
    return path
