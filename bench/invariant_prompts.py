"""What --batch-invariant costs on prompts, in process: ``TorchExecutor.prefill`` of one
prompt of 512, 1,024 and 2,048 tokens (prefix cache off) on the default kernels and on
the invariant ones, the two taking turns each round; the medians and their ratio
(invariant over default throughput), per dtype and ``--quantize`` mode.

    python -m bench.invariant_prompts [--modes float32:none,float32:w4a8] [--rounds 3]
        [--library other.so]   # another build of the kernels (e.g. before a change)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from bench.determinism import ARGMAX, _executor

LENGTHS = (512, 1024, 2048)


def prompt_s(ex, length: int, salt: int) -> float:
    ex.kv.prefix_caching = False
    prompt = [(37 * i + 101 * salt) % 40000 + 50 for i in range(length)]
    start = time.perf_counter()
    out = ex.prefill(prompt, None, ARGMAX)
    took = time.perf_counter() - start
    ex.release_cache(out.kv_cache.cache_id)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="float32:none,float32:w4a8")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--library", help="load this build of the kernels instead of csrc/'s")
    args = parser.parse_args()
    if args.library:
        from ferrum_rpc.server.kernels import build
        build.build_extension = lambda: args.library
    result = {"threads": torch.get_num_threads(), "library": args.library or "csrc"}
    for mode in args.modes.split(","):
        dtype, quantize = mode.split(":")
        pair = {inv: _executor(dtype, quantize, inv) for inv in (False, True)}
        for ex in pair.values():
            prompt_s(ex, 64, 0)  # warm up
        times = {(inv, n): [] for inv in pair for n in LENGTHS}
        for r in range(args.rounds):
            for n in LENGTHS:
                for inv, ex in (pair.items() if r % 2 == 0 else reversed(pair.items())):
                    times[inv, n].append(prompt_s(ex, n, r + 1))
        result[mode] = {f"prompt_{n}": {"default_s": statistics.median(times[False, n]),
                                        "invariant_s": statistics.median(times[True, n]),
                                        "invariant_vs_default": statistics.median(times[False, n])
                                        / statistics.median(times[True, n])} for n in LENGTHS}
        del pair
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
