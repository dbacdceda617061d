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

``--disaggregated`` runs the same load on two replicas through a
replica-set client instead, twice: two ordinary replicas (placement by load),
then one marked for prefill and one for decode (prompts run on the first, each
decoder's sequence moves to the second before its first step).  Each replica
gets ``--replica-threads`` torch threads (default 1: one core each on a 2-core
host) and the first of ``--budgets`` (default 128, the server's default).

    python -m bench.mixed [--seconds 20] [--decoders 32] [--prompters 2] [--budgets 0,64,128,256]
    python -m bench.mixed --disaggregated [--budgets 128] [--replica-threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
import threading
import time

import numpy as np

from bench.common import log, served, write_results
from ferrum_rpc.client import LogitsPolicy, connect
from ferrum_rpc.client.replicas import ReplicaPolicy
from ferrum_rpc.server.prepare import prepare_default_model

GREEDY = LogitsPolicy.argmax()


def phase(target: str | list[str], seconds: float, decoders: int, prompters: int, seed: int,
          policy: ReplicaPolicy | None = None) -> dict:
    """Runs the load for ``seconds`` on one server (or a replica set: a list of targets,
    placed by ``policy``); returns latency and throughput figures."""
    options = {"replica_policy": policy} if isinstance(target, list) else {}

    def client():
        return connect(target, timeout=600, **options)

    stop = threading.Event()
    latencies: list[float] = []
    ready = threading.Semaphore(0)  # a decoder's first step is done (with a replica set: its sequence moved)
    prompt_tokens = [0]
    lock = threading.Lock()

    def decode_loop(i: int) -> None:
        with client() as ex:
            out = ex.prefill([1 + (7 * i + j) % 4000 for j in range(16)], logits=GREEDY)
            handle, token = out.kv_cache, out.logits.argmax()[0]
            first = True
            while not stop.is_set():
                t0 = time.perf_counter()
                step = ex.decode(token, handle, GREEDY)
                dt = time.perf_counter() - t0
                with lock:
                    latencies.append(dt)
                handle, token = step.kv_cache, step.logits.argmax()[0]
                if first:
                    ready.release()
                    first = False
                if handle.sequence_length > 1500:  # stay well inside the pool
                    ex.release_cache(handle)
                    out = ex.prefill([1 + (7 * i + j) % 4000 for j in range(16)], logits=GREEDY)
                    handle, token = out.kv_cache, out.logits.argmax()[0]
            ex.release_cache(handle)

    def prompt_loop(i: int) -> None:
        rng = random.Random(seed + i)
        with client() as ex:
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
    for _ in range(decoders):  # every decoder has its sequence and has stepped once
        ready.acquire(timeout=300)
    time.sleep(1.0)
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
    parser.add_argument("--budgets", default=None,
                        help="step token budgets to compare, one server each (0: separate forwards; default "
                             "0,64,128,256, or 128, the server's default, with --disaggregated)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="two replicas, ordinary against one prefill + one decode (see above)")
    parser.add_argument("--replica-threads", type=int, default=1, help="torch threads of each replica")
    parser.add_argument("--out", default=None, help="results name (default: mixed, or mixed_disaggregated)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    records = []
    budgets = [int(b) for b in (args.budgets or ("128" if args.disaggregated else "0,64,128,256")).split(",")]
    if args.disaggregated:
        write_results(args.out or "mixed_disaggregated", disaggregated(args, budgets[0]))
        return
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
    write_results(args.out or "mixed", records)


def disaggregated(args, budget: int) -> list[dict]:
    """The load on two replicas: placed by load, then one prefill + one decode replica."""
    flags = ("--step-token-budget", str(budget), "--threads", str(args.replica_threads))
    records = []
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(served(str(prepare_default_model()), "float32", flags)) for _ in range(2)]
        logging.getLogger("ferrum_rpc.client").setLevel(logging.ERROR)  # a migration per decoder, by design
        for layout, roles in (("ordinary", {}), ("disaggregated", {targets[0]: "prefill", targets[1]: "decode"})):
            policy = ReplicaPolicy(roles=roles, seed=args.seed)
            rec = {"layout": layout, "replicas": 2, "step_token_budget": budget,
                   "replica_threads": args.replica_threads,
                   **phase(targets, args.seconds, args.decoders, args.prompters, args.seed, policy)}
            records.append(rec)
            log.info("%s, 2 replicas, %d decoders, %d prompters: decode p50 %.1f ms, p99 %.1f ms, "
                     "%.1f decode tokens/s, %.1f prompt tokens/s", layout, rec["decoders"], rec["prompters"],
                     rec["decode_p50_ms"], rec["decode_p99_ms"], rec["decode_tokens_per_s"],
                     rec["prompt_tokens_per_s"])
    return records


if __name__ == "__main__":
    main()
