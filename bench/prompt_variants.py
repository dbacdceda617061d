"""Prompt speed of several variants of the default model through gRPC, side by side.

One ``ferrum-rpc serve`` per variant (a dtype or a ``--quantize`` mode), all up at
once and idle while another runs.  Each round sends every server one prompt of
each of ``--prompt-lens`` tokens (BatchPrefill of one prompt, greedy logits of its
last position, then its KV released), the variants taking turns, every prompt
unlike the others so none is served from a cached prefix.  A row is a variant's
median over ``--repeats`` rounds and, beside the first variant, the median of the
rounds' own speed ratios (``per_round_vs``): a host whose speed drifts moves every
variant alike.  Each row also shows its share of the GEMM peak torch reaches here
(float32's for the quantized modes, as ``bench.decode_throughput`` does).

    .venv/bin/python -m bench.prompt_variants [--variants float32 w4a8 bfloat16] [--prompt-lens 512]
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import statistics
from concurrent.futures import ThreadPoolExecutor

from bench.common import bench_server, compute_peak_gflops, dtype_and_quantize, log, write_results
from bench.decode_throughput import grpc_calls, peak_dtype
from bench.long_rows import distinct_prompts, model_config, ours_prompt_s, prompt_flops
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.prepare import prepare_default_model


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["float32", "w4a8", "bfloat16"],
                        help="dtypes or --quantize modes; the first is the others' reference")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[512])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", default="prompt_variants")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = str(prepare_default_model())
    cfg = model_config(model_dir)
    peaks = {d: max(compute_peak_gflops(d) for _ in range(3)) for d in {peak_dtype(v) for v in args.variants}}
    log.info("GEMM peaks: %s", ", ".join(f"{d} {p:.1f} GFLOP/s" for d, p in peaks.items()))
    kv_tokens = max(args.prompt_lens) * 2 + 1024
    records = []
    pool = ThreadPoolExecutor(2)
    with contextlib.ExitStack() as stack:
        calls = {}
        for variant in args.variants:
            dtype, quantize = dtype_and_quantize(variant)
            server = stack.enter_context(bench_server(model_dir, dtype, kv_tokens, "--quantize", quantize))
            server.wait_serving(300)
            client = stack.enter_context(ExecutorClient(server.target, timeout=600))
            calls[variant] = grpc_calls(client, pool)
        first = args.variants[0]
        for tokens in args.prompt_lens:
            for variant in args.variants:  # warm-ups
                ours_prompt_s(calls[variant], distinct_prompts(1, tokens, salt=-1)[0])
            runs = {variant: [] for variant in args.variants}
            for k in range(args.repeats):
                prompt = distinct_prompts(1, tokens, salt=k)[0]
                for variant in args.variants:
                    runs[variant].append(ours_prompt_s(calls[variant], prompt))
            flops = prompt_flops(cfg, tokens)
            for variant, seconds in runs.items():
                s = statistics.median(seconds)
                peak = peaks[peak_dtype(variant)]
                ratio = statistics.median([a / b for a, b in zip(runs[first], seconds)])
                records.append({"kind": "prompt", "system": "grpc", "dtype": variant, "prompt_tokens": tokens,
                                "tokens_per_s": round(tokens / s, 2), "ms": round(1e3 * s, 2),
                                "seconds": [round(r, 4) for r in seconds], "gflops": round(flops / s / 1e9, 1),
                                "peak_gflops": round(peak, 1), "limit_share": round(flops / s / 1e9 / peak, 3),
                                "per_round_vs": {first: round(ratio, 3)}})
                log.info("%-9s prompt %5d: %8.1f tokens/s, %.0f%% of the %s peak, %.2fx %s (median of %d rounds' "
                         "ratios)", variant, tokens, tokens / s, 100 * records[-1]["limit_share"],
                         peak_dtype(variant), ratio, first, len(seconds))
    write_results(args.out, records, {"peak_gflops": {d: round(p, 1) for d, p in peaks.items()}})
    print("| variant | prompt tokens | tokens/s | ms | share of GEMM peak | per round vs " + first + " |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in records:
        print(f"| {r['dtype']} | {r['prompt_tokens']} | {r['tokens_per_s']:.1f} | {r['ms']:.1f} "
              f"| {r['limit_share']:.0%} | {r['per_round_vs'][first]:.2f}x |")


if __name__ == "__main__":
    main()
