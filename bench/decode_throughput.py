"""Decode throughput of the default model: transformers generate vs our executor
in-process vs our executor through gRPC, side by side in one run.

Prompt 32 tokens, 64 new tokens, greedy; output tokens per second end to end
(prefill included, as a user sees it: a batch's prompts are sent together and
share padded forwards) and decode-only (the prefill part
subtracted: for transformers, the same generate call stopped after one
token), each figure the median of several runs.

    python -m bench.decode_throughput [--batches 1 8 32] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench.common import log, median_of, served, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.executor import TORCH_DTYPES, TorchExecutor
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.types import DecodeInput, LogitsPolicy

GREEDY = LogitsPolicy.argmax()
PREFILL_SECONDS: list[float] = []  # prefill part of each run of ours, for the decode-only figure


def prompts(batch: int, length: int) -> list[list[int]]:
    return [[1 + (7 * b + 13 * i) % 4000 for i in range(length)] for b in range(batch)]


def run_ours(prefill_all, batch_decode, release, batch_prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy generation through our contract (in-process executor or gRPC client): seconds."""
    start = time.perf_counter()
    outs = prefill_all(batch_prompts)
    PREFILL_SECONDS.append(time.perf_counter() - start)
    handles = [o.kv_cache for o in outs]
    tokens = [o.logits.argmax()[0] for o in outs]
    for _ in range(new_tokens - 1):
        steps = batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)])
        handles = [s.kv_cache for s in steps]
        tokens = [s.logits.argmax()[0] for s in steps]
    elapsed = time.perf_counter() - start
    for h in handles:
        release(h.cache_id)
    return elapsed


def run_executor(ex: TorchExecutor, batch_prompts: list[list[int]], new_tokens: int) -> float:
    def prefill_all(prompts):  # one padded forward, as the worker does for prompts arriving together
        return ex.run_prefills([ex.plan_prefill(p, None, GREEDY) for p in prompts])

    return run_ours(prefill_all, lambda items: ex.batch_decode(items, GREEDY), ex.release_cache,
                    batch_prompts, new_tokens)


def run_grpc(client: ExecutorClient, pool: ThreadPoolExecutor, batch_prompts: list[list[int]],
             new_tokens: int) -> float:
    def prefill_all(prompts):  # sent together; the server batches them
        return list(pool.map(lambda p: client.prefill(p, logits=GREEDY), prompts))

    return run_ours(prefill_all, lambda items: client.batch_decode(items, GREEDY), client.release_cache,
                    batch_prompts, new_tokens)


def run_transformers(model, batch_prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch_prompts)
    if new_tokens > 1:  # the prefill part: the same call stopping after its first token
        PREFILL_SECONDS.append(run_transformers(model, batch_prompts, 1))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+", default=["transformers", "executor", "grpc"])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="decode_throughput")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = str(prepare_default_model())
    records = []

    def record(system, dtype, batch, seconds, runs, prefill_s):
        tps = batch * args.new_tokens / seconds
        decode_tps = batch * (args.new_tokens - 1) / (seconds - prefill_s)
        records.append({"system": system, "dtype": dtype, "batch": batch, "tokens_per_s": round(tps, 2),
                        "decode_tokens_per_s": round(decode_tps, 2), "prefill_s": round(prefill_s, 4),
                        "seconds": [round(r, 4) for r in runs], "new_tokens": args.new_tokens,
                        "prompt_len": args.prompt_len})
        log.info("%-12s %-8s batch %3d: %8.1f tokens/s end to end, %8.1f decode-only",
                 system, dtype, batch, tps, decode_tps)

    for dtype in args.dtypes:
        runners = {}
        if "transformers" in args.systems:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()
            runners["transformers"] = lambda p, m=hf: run_transformers(m, p, args.new_tokens)
        if "executor" in args.systems:
            ex = TorchExecutor.from_path("bench", model_dir, ExecutorConfig(dtype=dtype, kv_tokens=32768))
            runners["executor"] = lambda p, e=ex: run_executor(e, p, args.new_tokens)
        with served(model_dir, dtype) if "grpc" in args.systems else _null() as target:
            if target:
                client = ExecutorClient(target, timeout=600)
                pool = ThreadPoolExecutor(max(args.batches))
                runners["grpc"] = lambda p, c=client: run_grpc(c, pool, p, args.new_tokens)
            for batch in args.batches:
                batch_prompts = prompts(batch, args.prompt_len)
                for system, run in runners.items():
                    run(batch_prompts[:1])  # warm-up
                    PREFILL_SECONDS.clear()
                    seconds, runs = median_of(args.repeats, lambda: run(batch_prompts))
                    record(system, dtype, batch, seconds, runs, statistics.median(PREFILL_SECONDS))
        runners.clear()
    write_results(args.out, records)
    print_table(records)
    print_table(records, "decode_tokens_per_s")


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def print_table(records: list[dict], key: str = "tokens_per_s") -> None:
    print(f"output tokens/s ({key}):")
    by_key = {(r["system"], r["dtype"], r["batch"]): r[key] for r in records}
    systems = sorted({r["system"] for r in records})
    print(f"{'dtype':9} {'batch':>5} " + " ".join(f"{s:>13}" for s in systems) + "  grpc/exec  grpc/hf")
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in records}):
        row = [by_key.get((s, dtype, batch)) for s in systems]
        g, e, h = (by_key.get((s, dtype, batch)) for s in ("grpc", "executor", "transformers"))
        ratio = lambda a, b: f"{a / b:9.2f}" if a and b else f"{'-':>9}"
        print(f"{dtype:9} {batch:5d} " + " ".join(f"{v:13.1f}" if v else f"{'-':>13}" for v in row)
              + f" {ratio(g, e)} {ratio(g, h)}")


if __name__ == "__main__":
    main()
