"""Decode latency under a mixed load: callers decoding while long prompts arrive.

``--decoders`` callers (default 32) each hold one sequence and decode greedily
through unary Decode calls, while ``--prompters`` callers (default 2) send
prompts of 200-1,000 tokens (seeded lengths) back to back.  Reported: decode
step latency p50/p99 and decode tokens/s while prompts are arriving, and
prompt tokens/s; the decode-only figures without prompts, same run, for
comparison.  Each ``--budgets`` value is a server run with that
``--step-token-budget``: 0 is the schedule before the unified forward
(prompt chunks and decode batches alternate in separate forwards), the
others put decodes and prompt parts in one forward under that budget.

    python -m bench.mixed [--seconds 20] [--decoders 32] [--prompters 2] [--budgets 0,64,128,256]
"""

from __future__ import annotations

import argparse
import logging
import random
import threading
import time

import numpy as np

from bench.common import log, served, write_results
from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.server.prepare import prepare_default_model

GREEDY = LogitsPolicy.argmax()


def phase(target: str, seconds: float, decoders: int, prompters: int, seed: int) -> dict:
    """Runs the load for ``seconds``; returns latency and throughput figures."""
    stop = threading.Event()
    latencies: list[float] = []
    prompt_tokens = [0]
    lock = threading.Lock()

    def decode_loop(i: int) -> None:
        with ExecutorClient(target, timeout=600) as ex:
            out = ex.prefill([1 + (7 * i + j) % 4000 for j in range(16)], logits=GREEDY)
            handle, token = out.kv_cache, out.logits.argmax()[0]
            while not stop.is_set():
                t0 = time.perf_counter()
                step = ex.decode(token, handle, GREEDY)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                handle, token = step.kv_cache, step.logits.argmax()[0]
                if handle.sequence_length > 1500:  # stay well inside the pool
                    ex.release_cache(handle)
                    out = ex.prefill([1 + (7 * i + j) % 4000 for j in range(16)], logits=GREEDY)
                    handle, token = out.kv_cache, out.logits.argmax()[0]
            ex.release_cache(handle)

    def prompt_loop(i: int) -> None:
        rng = random.Random(seed + i)
        with ExecutorClient(target, timeout=600) as ex:
            while not stop.is_set():
                n = rng.randint(200, 1000)
                out = ex.prefill([rng.randint(1, 4000) for _ in range(n)], logits=GREEDY)
                ex.release_cache(out.kv_cache)
                with lock:
                    prompt_tokens[0] += n

    threads = [threading.Thread(target=decode_loop, args=(i,)) for i in range(decoders)]
    threads += [threading.Thread(target=prompt_loop, args=(i,)) for i in range(prompters)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # every decoder has its sequence
    with lock:
        latencies.clear()
        prompt_tokens[0] = 0
    start = time.perf_counter()
    time.sleep(seconds)
    with lock:
        measured, tokens = list(latencies), prompt_tokens[0]
    elapsed = time.perf_counter() - start
    stop.set()
    for t in threads:
        t.join()
    ms = np.array(measured) * 1e3
    return {"decoders": decoders, "prompters": prompters, "seconds": round(elapsed, 2),
            "decode_p50_ms": round(float(np.percentile(ms, 50)), 1),
            "decode_p99_ms": round(float(np.percentile(ms, 99)), 1),
            "decode_tokens_per_s": round(len(ms) / elapsed, 1),
            "prompt_tokens_per_s": round(tokens / elapsed, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--decoders", type=int, default=32)
    parser.add_argument("--prompters", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--budgets", default="0,64,128,256",
                        help="step token budgets to compare, one server each (0: separate forwards)")
    parser.add_argument("--out", default="mixed")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    records = []
    budgets = [int(b) for b in args.budgets.split(",")]
    for budget in budgets:
        with served(str(prepare_default_model()), "float32", ("--step-token-budget", str(budget))) as target:
            for prompters in ((0, args.prompters) if budget == budgets[0] else (args.prompters,)):
                rec = {"step_token_budget": budget,
                       **phase(target, args.seconds, args.decoders, prompters, args.seed)}
                records.append(rec)
                log.info("budget %d, %d decoders, %d prompters: decode p50 %.1f ms, p99 %.1f ms, "
                         "%.1f decode tokens/s, %.1f prompt tokens/s", budget, rec["decoders"], rec["prompters"],
                         rec["decode_p50_ms"], rec["decode_p99_ms"], rec["decode_tokens_per_s"],
                         rec["prompt_tokens_per_s"])
    write_results(args.out, records)


if __name__ == "__main__":
    main()
