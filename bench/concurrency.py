"""Many independent callers through gRPC: each generates 64 tokens greedily on
its own sequence with unary Decode calls; the server coalesces them.

Reports aggregate output tokens/s, p50/p99 step latency (client-observed), and
the mean batch size of the forwards that served the steps.

    python -m bench.concurrency [--callers 1 4 16 32 64] [--dtype float32]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time

import numpy as np

from bench.common import log, served, write_results
from ferrum_rpc.client import AsyncExecutorClient, LogitsPolicy
from ferrum_rpc.server.prepare import prepare_default_model

GREEDY = LogitsPolicy.argmax()


async def one_caller(target: str, index: int, prompt_len: int, new_tokens: int,
                     prefilled: asyncio.Queue, start: asyncio.Event):
    async with AsyncExecutorClient(target, timeout=600) as ex:
        prompt = [1 + (7 * index + 13 * i) % 4000 for i in range(prompt_len)]
        out = await ex.prefill(prompt, logits=GREEDY)
        handle, token = out.kv_cache, out.logits.argmax()[0]
        prefilled.put_nowait(index)
        await start.wait()
        latencies, batches = [], []
        for _ in range(new_tokens - 1):
            t0 = time.perf_counter()
            step = await ex.decode(token, handle, logits=GREEDY)
            latencies.append(time.perf_counter() - t0)
            batches.append(step.timing.batch_size)
            handle, token = step.kv_cache, step.logits.argmax()[0]
        await ex.release_cache(handle)
        return latencies, batches


async def run(target: str, callers: int, prompt_len: int, new_tokens: int) -> dict:
    start, prefilled = asyncio.Event(), asyncio.Queue()
    tasks = [asyncio.create_task(one_caller(target, i, prompt_len, new_tokens, prefilled, start))
             for i in range(callers)]
    for _ in range(callers):  # every prompt is in before the decode phase is timed
        await prefilled.get()
    t0 = time.perf_counter()
    start.set()
    results = await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - t0
    latencies = np.array([x for lat, _ in results for x in lat]) * 1000
    batches = [b for _, bs in results for b in bs]
    return {
        "callers": callers,
        "tokens_per_s": round(callers * (new_tokens - 1) / elapsed, 2),
        "p50_ms": round(float(np.percentile(latencies, 50)), 2),
        "p99_ms": round(float(np.percentile(latencies, 99)), 2),
        "mean_batch": round(statistics.mean(batches), 2),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--callers", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default="concurrency")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    records = []
    with served(str(prepare_default_model()), args.dtype) as target:
        asyncio.run(run(target, 2, args.prompt_len, 4))  # warm-up
        for n in args.callers:
            rec = {"system": "grpc", "dtype": args.dtype, **asyncio.run(run(target, n, args.prompt_len, args.new_tokens))}
            records.append(rec)
            log.info("%3d callers: %7.1f tokens/s  p50 %6.1f ms  p99 %6.1f ms  mean batch %.1f",
                     n, rec["tokens_per_s"], rec["p50_ms"], rec["p99_ms"], rec["mean_batch"])
    write_results(args.out, records)
    base = records[0]["tokens_per_s"]
    print(f"{'callers':>7} {'tokens/s':>9} {'x one':>6} {'p50 ms':>7} {'p99 ms':>7} {'batch':>6}")
    for r in records:
        print(f"{r['callers']:7d} {r['tokens_per_s']:9.1f} {r['tokens_per_s'] / base:6.2f} "
              f"{r['p50_ms']:7.1f} {r['p99_ms']:7.1f} {r['mean_batch']:6.1f}")


if __name__ == "__main__":
    main()
