"""What --batch-invariant costs on prompts, in process: ``TorchExecutor.prefill`` of one
prompt of 512, 1,024 and 2,048 tokens (prefix cache off) on the default kernels and on
the invariant ones, the two taking turns each round; the medians and their ratio
(invariant over default throughput), per dtype and ``--quantize`` mode.

    python -m bench.invariant_prompts [--modes float32:none,float32:w4a8] [--rounds 3]
        [--library other.so]   # another build of the kernels (e.g. before a change)
        [--threads 1 --cpu-time]  # this thread's CPU time, not wall time (a loaded host)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.determinism import ARGMAX
from ferrum_rpc.paths import default_model_dir
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor

LENGTHS = (512, 1024, 2048)


def _executor(dtype: str, quantize: str, invariant: bool) -> TorchExecutor:
    return TorchExecutor.from_path("m", default_model_dir(), ExecutorConfig(
        dtype=dtype, quantize=quantize, kv_tokens=4096, batch_invariant=invariant, max_batch_size=4))


def prompt_s(ex, length: int, salt: int, clock=time.perf_counter) -> float:
    ex.kv.prefix_caching = False
    prompt = [(37 * i + 101 * salt) % 40000 + 50 for i in range(length)]
    start = clock()
    out = ex.prefill(prompt, None, ARGMAX)
    took = clock() - start
    ex.release_cache(out.kv_cache.cache_id)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="float32:none,float32:w4a8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--library", help="load this build of the kernels instead of csrc/'s")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--cpu-time", action="store_true", help="one thread's CPU time (with --threads 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    if args.library:
        from ferrum_rpc.server.kernels import build
        build.build_extension = lambda: args.library
    result = {"threads": args.threads, "clock": "thread cpu time" if args.cpu_time else "wall",
              "library": args.library or "csrc"}
    for mode in args.modes.split(","):
        dtype, quantize = mode.split(":")
        pair = {inv: _executor(dtype, quantize, inv) for inv in (False, True)}
        for ex in pair.values():
            prompt_s(ex, 64, 0)  # warm up
        times = {(inv, n): [] for inv in pair for n in LENGTHS}
        for r in range(args.rounds):
            for n in LENGTHS:
                for inv, ex in (pair.items() if r % 2 == 0 else reversed(pair.items())):
                    times[inv, n].append(prompt_s(ex, n, r + 1, clock))
        result[mode] = {f"prompt_{n}": {"default_s": statistics.median(times[False, n]),
                                        "invariant_s": statistics.median(times[True, n]),
                                        "invariant_vs_default": statistics.median(times[False, n])
                                        / statistics.median(times[True, n])} for n in LENGTHS}
        del pair
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
