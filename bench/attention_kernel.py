"""The fused paged attention alone, at SmolLM2-135M's shapes (9 heads, 3 kv heads, dim
64, 30 layers), two builds side by side: each round runs one process per library,
alternating, and the rows are the medians.

Decode rows: a step's 30 layers of attention for batch 1 or 8 sequences of 2,048 or
8,192 tokens of context, each layer's K and V in its own pool (what a step reads is
bigger than the caches), against the floor of reading that KV once at ``--gbps``.
Prompt rows: one layer's attention over a prompt of 512, 1,024 or 2,048 tokens, next to
torch's scaled_dot_product_attention (what the default model runs for prompts).

    python -m bench.attention_kernel --before /path/old.so [--rounds 3] [--threads 1 --cpu-time]
        [--dtype bfloat16] [--rows prompt]

``--dtype``: the queries, keys, values and pool (float32, or bfloat16 as a bfloat16
model's; int8: float32 activations over an int8 pool, --kv-dtype int8, each row's
blocks of 32 with their float16 scales); ``--rows``: only the decode or only the
prompt rows.

``--cpu-time``: the one thread's CPU time instead of wall time (on a loaded host, what
the kernel costs rather than how long it waited for a core); with one thread only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

H, HKV, D, LAYERS, BS = 9, 3, 64, 30, 16
_clock = time.perf_counter  # or time.thread_time (--cpu-time)
POOL_BYTES = 400 << 20  # layers beyond this many bytes of pool cycle over the first ones


def _load(library: str | None) -> None:
    if library:
        torch.ops.load_library(library)
    else:
        from ferrum_rpc.server.kernels.build import load_library
        load_library()


_dtype = torch.float32  # of the queries, keys, values and pool (--dtype)
_pool_int8 = False  # --dtype int8: float32 activations, an int8 pool with its scales


def _randn(*shape, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(_dtype)


def _pool(*shape, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A pool layer of ``shape`` (blocks, block_size, kv heads, D) holding random rows:
    the activations' dtype, or int8 values and their scales (kv/pool.py's quantize_rows)."""
    x = torch.randn(*shape, generator=gen)
    if not _pool_int8:
        return x.to(_dtype), None
    from ferrum_rpc.server.kv.pool import quantize_rows
    return quantize_rows(x)


def _zeros_pool(*shape) -> tuple[torch.Tensor, torch.Tensor | None]:
    if not _pool_int8:
        return torch.zeros(*shape, dtype=_dtype), None
    from ferrum_rpc.server.kv.pool import SCALE_DTYPE, scale_blocks
    return torch.zeros(*shape, dtype=torch.int8), torch.zeros(*shape[:-1], scale_blocks(shape[-1]), dtype=SCALE_DTYPE)


def _case(batch: int, ctx: int, gen: torch.Generator):
    per_layer = batch * ctx * HKV * D * 2 * (1 if _pool_int8 else _dtype.itemsize)
    pools = max(1, min(LAYERS, POOL_BYTES // per_layer))
    blocks = batch * ((ctx + BS - 1) // BS)
    k = [_pool(blocks, BS, HKV, D, gen=gen) for _ in range(pools)]
    v = [_pool(blocks, BS, HKV, D, gen=gen) for _ in range(pools)]
    tables = torch.randperm(blocks, generator=gen).view(batch, -1)
    return k, v, tables


def _decode_ms(batch: int, ctx: int, gen: torch.Generator, steps: int = 5) -> float:
    k, v, tables = _case(batch, ctx, gen)
    cos, sin = torch.ones(ctx, D), torch.zeros(ctx, D)
    pos = torch.full((batch, 1), ctx - 1)
    slots = tables[:, -1] * BS + (ctx - 1) % BS
    q = _randn(batch, 1, H, D, gen=gen)
    kn, vn = _randn(batch, 1, HKV, D, gen=gen), _randn(batch, 1, HKV, D, gen=gen)
    times = []
    for _ in range(steps):
        start = _clock()
        for layer in range(LAYERS):
            i = layer % len(k)
            torch.ops.ferrum_fused.paged_attention(q, kn, vn, cos, sin, pos, k[i][0], v[i][0], slots, tables, 0.125,
                                                   k[i][1], v[i][1])
        times.append(_clock() - start)
    return 1e3 * statistics.median(times)


def _prompt_ms(tokens: int, gen: torch.Generator, repeats: int = 3) -> tuple[float, float]:
    blocks = (tokens + BS - 1) // BS
    (k_cache, k_scale), (v_cache, v_scale) = _zeros_pool(blocks, BS, HKV, D), _zeros_pool(blocks, BS, HKV, D)
    table = torch.randperm(blocks, generator=gen)
    pos = torch.arange(tokens)
    slots = table[pos // BS] * BS + pos % BS
    q = _randn(1, tokens, H, D, gen=gen)
    k, v = _randn(1, tokens, HKV, D, gen=gen), _randn(1, tokens, HKV, D, gen=gen)
    cos, sin = torch.ones(tokens, D), torch.zeros(tokens, D)
    fused, sdpa = [], []
    for _ in range(repeats):
        start = _clock()
        torch.ops.ferrum_fused.paged_attention(q, k, v, cos, sin, pos[None], k_cache, v_cache, slots, table[None],
                                               0.125, k_scale, v_scale)
        fused.append(_clock() - start)
        start = _clock()
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                       enable_gqa=True)
        sdpa.append(_clock() - start)
    return 1e3 * statistics.median(fused), 1e3 * statistics.median(sdpa)


def measure(library: str | None, threads: int, cpu_time: bool, dtype: str = "float32",
            rows_of: tuple[str, ...] = ("decode", "prompt")) -> dict:
    _load(library)
    torch.set_num_threads(threads)
    global _clock, _dtype, _pool_int8
    _clock = time.thread_time if cpu_time else time.perf_counter
    _pool_int8 = dtype == "int8"
    _dtype = torch.float32 if _pool_int8 else getattr(torch, dtype)
    gen = torch.Generator().manual_seed(0)
    rows = {}
    for batch in (1, 8) if "decode" in rows_of else ():
        for ctx in (2048, 8192):
            rows[f"decode_b{batch}_{ctx}_ms"] = _decode_ms(batch, ctx, gen)
    for tokens in (512, 1024, 2048) if "prompt" in rows_of else ():
        rows[f"prompt_{tokens}_ms"], rows[f"prompt_{tokens}_sdpa_ms"] = _prompt_ms(tokens, gen)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the other build's library (.so)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gbps", type=float, default=30.0, help="read bandwidth for the decode floor")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu-time", action="store_true")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "int8"], default="float32")
    parser.add_argument("--rows", nargs="+", choices=["decode", "prompt"], default=["decode", "prompt"])
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: measure this library ("" ours)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(measure(args.one or None, args.threads, args.cpu_time, args.dtype, tuple(args.rows))))
        return
    runs = {"before": [], "after": []}
    for _ in range(args.rounds):
        for name, lib in (("before", args.before), ("after", "")):
            flags = ["--threads", str(args.threads), "--dtype", args.dtype, "--rows", *args.rows]
            flags += ["--cpu-time"] if args.cpu_time else []
            out = subprocess.run([sys.executable, "-m", "bench.attention_kernel", "--before", args.before, *flags,
                                  "--one", lib],
                                 capture_output=True, text=True, check=True).stdout
            runs[name].append(json.loads(out.strip().splitlines()[-1]))
    result = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    for batch in (1, 8) if "decode" in args.rows else ():
        for ctx in (2048, 8192):
            key = f"decode_b{batch}_{ctx}_ms"
            row = D + 2 * 2 if args.dtype == "int8" else D * getattr(torch, args.dtype).itemsize  # int8: + 2 scales
            floor = batch * ctx * LAYERS * HKV * row * 2 / (args.gbps * 1e9) * 1e3
            result.setdefault("floor", {})[key] = floor
    result["threads"], result["clock"] = args.threads, "thread cpu time" if args.cpu_time else "wall"
    result["dtype"] = args.dtype
    for key in result["after"]:
        result.setdefault("after_vs_before", {})[key] = result["after"][key] / result["before"][key]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
