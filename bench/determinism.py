"""Batch invariance on the real model, in process: how many seeded generations change
their text when their sequence shares the forward or its prompt comes from the prefix
cache (--batch-invariant off, the per-shape kernels, vs on, the default), and what
the invariant kernels cost in decode (batch 1 and 32) and prompt throughput, side by
side in one run (medians of rounds in which the two take turns, and their ratios); per
dtype and ``--quantize`` mode.

    python -m bench.determinism [--seeds 64] [--tokens 32] [--repeats 3] [--threads N]
        [--dtypes float32,bfloat16] [--quantize none,w4a8,int8] [--name determinism]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import random
import statistics
import time

import torch

from bench.common import write_results
from ferrum_rpc.paths import default_model_dir
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.types import DecodeInput, LogitsPolicy, TokenChoice

log = logging.getLogger("bench.determinism")
ARGMAX = LogitsPolicy.argmax()


def _executor(dtype: str, quantize: str, invariant: bool) -> TorchExecutor:
    return TorchExecutor.from_path("m", default_model_dir(), ExecutorConfig(
        dtype=dtype, quantize=quantize, kv_tokens=65536, batch_invariant=invariant, max_batch_size=64))


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(100, 40000) for _ in range(rng.randrange(5, 61))] for _ in range(n)]


def _generate(ex: TorchExecutor, prompts, seeds, tokens: int, together: bool) -> list[list[int]]:
    """Each prompt's seeded text: one sequence at a time, or all in one batch each step."""
    choices = [TokenChoice(temperature=1.0, seed=s) for s in seeds]
    outs = [ex.prefill(p, None, None, choice=c) for p, c in zip(prompts, choices)]
    texts = [[o.chosen.token_id] for o in outs]
    handles = [o.kv_cache for o in outs]
    for _ in range(tokens - 1):
        groups = [list(range(len(prompts)))] if together else [[i] for i in range(len(prompts))]
        for group in groups:
            step = ex.batch_decode([DecodeInput(texts[i][-1], handles[i], choices[i]) for i in group], None)
            for i, out in zip(group, step):
                texts[i].append(out.chosen.token_id)
                handles[i] = out.kv_cache
    for h in handles:
        ex.release_cache(h.cache_id)
    return texts


def divergence(ex: TorchExecutor, seeds: int, tokens: int) -> dict:
    prompts, ids = _prompts(seeds), list(range(seeds))
    ex.kv.prefix_caching = False
    cold = _generate(ex, prompts, ids, tokens, together=False)
    ex.kv.prefix_caching = True
    _generate(ex, prompts, ids, 1, together=False)  # the prompts now sit in the prefix cache
    warm = _generate(ex, prompts, ids, tokens, together=False)
    batched = _generate(ex, prompts, ids, tokens, together=True)  # prompts from the cache, one batch
    differ = lambda a, b: sum(x != y for x, y in zip(a, b))  # noqa: E731
    return {"seeds": seeds, "tokens": tokens, "cache_hit_vs_cold": differ(warm, cold),
            "batch_of_all_vs_alone": differ(batched, warm)}


def _step_ms(ex: TorchExecutor, batch: int, steps: int = 8) -> float:
    handles = [ex.prefill([100 + i, 200, 300, 400 + i], None, ARGMAX).kv_cache for i in range(batch)]
    for _ in range(2):
        handles = [o.kv_cache for o in ex.batch_decode([DecodeInput(5, h) for h in handles], ARGMAX)]
    start = time.perf_counter()
    for _ in range(steps):
        handles = [o.kv_cache for o in ex.batch_decode([DecodeInput(5, h) for h in handles], ARGMAX)]
    ms = (time.perf_counter() - start) / steps * 1e3
    for h in handles:
        ex.release_cache(h.cache_id)
    return ms


def _prompt_tps(ex: TorchExecutor, length: int = 512, repeats: int = 2) -> float:
    ex.kv.prefix_caching = False
    best = float("inf")
    for r in range(repeats + 1):
        prompt = [(37 * i + r) % 40000 + 50 for i in range(length)]
        start = time.perf_counter()
        out = ex.prefill(prompt, None, ARGMAX)
        took = time.perf_counter() - start
        ex.release_cache(out.kv_cache.cache_id)
        if r:
            best = min(best, took)
    ex.kv.prefix_caching = True
    return length / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--quantize", default="none", help="--quantize modes, comma-separated (none: float weights)")
    parser.add_argument("--name", default="determinism", help="the results file, bench/results/NAME.json")
    parser.add_argument("--repeats", type=int, default=3,
                        help="throughput rounds, the two kernels taking turns in each; medians are recorded")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = []
    for dtype, quantize in itertools.product(args.dtypes.split(","), args.quantize.split(",")):
        pair = {invariant: _executor(dtype, quantize, invariant) for invariant in (False, True)}
        found = {invariant: divergence(ex, args.seeds, args.tokens) for invariant, ex in pair.items()}
        rounds = {invariant: {"decode_b1_tok_s": [], "decode_b32_tok_s": [], "prompt_512_tok_s": []}
                  for invariant in pair}
        for _ in range(args.repeats):  # taking turns, so a noisy spell on a shared host hits both
            for invariant, ex in pair.items():
                rounds[invariant]["decode_b1_tok_s"].append(1e3 / _step_ms(ex, 1))
                rounds[invariant]["decode_b32_tok_s"].append(32e3 / _step_ms(ex, 32))
                rounds[invariant]["prompt_512_tok_s"].append(_prompt_tps(ex))
        for invariant in pair:
            record = {"dtype": dtype, "quantize": quantize, "batch_invariant": invariant, "threads": torch.get_num_threads(),
                      **found[invariant], **{k: statistics.median(v) for k, v in rounds[invariant].items()}}
            if invariant:
                base = records[-1]
                record["vs_off"] = {k: record[k] / base[k] for k in rounds[invariant]}
            print({k: round(v, 1) if isinstance(v, float) else v for k, v in record.items()}, flush=True)
            records.append(record)
        del pair
    print("written:", write_results(args.name, records))


if __name__ == "__main__":
    main()
