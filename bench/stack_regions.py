"""The layer stack's one-region step against a layer_step a layer, in process: batch
decode steps and prompts of the batch-invariant default model, the two taking turns.

``DecodeStack.set_regions`` switches one executor between running a forward as one
OpenMP region (every layer's phases meeting at barriers) and one ``layer_step`` a layer
(each op its own parallel loop); the two give the same bits, so each round also checks
that they chose the same greedy tokens.  For each variant and each batch (``--batches``:
that many sequences after 32-token prompts, ``--steps`` greedy steps each way, the
median step) and each prompt length (``--prompt-lens``: one prompt each way, prompts
unlike one another so the prefix cache serves none), the rows keep the median of the
rounds' own ratios, region / layer_step.

    .venv/bin/python -m bench.stack_regions [--variants bfloat16 float32 w4a8] [--batches 8 32 64]
        [--prompt-lens 512] [--rounds 6] [--steps 24]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from bench.common import dtype_and_quantize, log, write_results
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.types import DecodeInput, TokenChoice

GREEDY = TokenChoice(temperature=0.0)


def prompt(ex: TorchExecutor, length: int, seed: int) -> list[int]:
    """Token ids for a prompt, each seed's unlike the others', inside the model's vocabulary."""
    vocab = ex.model_config.vocab_size
    span, base = min(4000, vocab // 2), min(100, vocab // 4)
    return [(17 * i + 5 + 31 * seed) % span + base for i in range(length)]


def decode_ms(ex: TorchExecutor, batch: int, steps: int, seed: int) -> tuple[float, list[list[int]]]:
    """The median step of ``batch`` sequences decoding greedily, and the tokens chosen."""
    outs = [ex.prefill(prompt(ex, 32, seed * 101 + b), choice=GREEDY) for b in range(batch)]
    items = [DecodeInput(o.chosen.token_id, o.kv_cache, GREEDY) for o in outs]
    times, tokens = [], []
    for _ in range(steps):
        start = time.perf_counter()
        outs = ex.batch_decode(items, None)
        times.append(time.perf_counter() - start)
        items = [DecodeInput(o.chosen.token_id, o.kv_cache, GREEDY) for o in outs]
        tokens.append([o.chosen.token_id for o in outs])
    for item in items:
        ex.release_cache(item.kv_cache.cache_id)
    return statistics.median(times) * 1e3, tokens


def prompt_ms(ex: TorchExecutor, length: int, seed: int) -> float:
    start = time.perf_counter()
    out = ex.prefill(prompt(ex, length, seed), choice=GREEDY)
    elapsed = time.perf_counter() - start
    ex.release_cache(out.kv_cache.cache_id)
    return elapsed * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["bfloat16", "float32", "w4a8"])
    parser.add_argument("--batches", nargs="*", type=int, default=[8, 32, 64])
    parser.add_argument("--prompt-lens", nargs="*", type=int, default=[512])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--out", default="stack_regions")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = str(prepare_default_model())
    executors = {}
    for variant in args.variants:
        dtype, quantize = dtype_and_quantize(variant)
        ex = TorchExecutor.from_path(variant, model_dir, ExecutorConfig(dtype=dtype, quantize=quantize,
                                                                        kv_tokens=16384))
        if ex.model.layer_ops is None:
            raise SystemExit(f"{variant}: the model has no layer stack to compare")
        decode_ms(ex, 2, 4, 0)  # warm-up
        executors[variant] = ex
    cases = [("decode", b) for b in args.batches] + [("prompt", n) for n in args.prompt_lens]
    times: dict[tuple, dict[bool, list[float]]] = {}
    seed = 1
    for r in range(args.rounds):
        for variant, ex in executors.items():
            for kind, size in cases:
                chosen = {}
                for region in ((False, True) if r % 2 == 0 else (True, False)):
                    ex.model.layer_ops.set_regions(region)
                    seed += 1
                    if kind == "decode":
                        ms, chosen[region] = decode_ms(ex, size, args.steps, r)
                    else:
                        ms = prompt_ms(ex, size, seed)  # a new prompt each time: no prefix cache
                    times.setdefault((variant, kind, size), {False: [], True: []})[region].append(ms)
                if kind == "decode" and chosen[False] != chosen[True]:
                    raise SystemExit(f"{variant} batch {size}: the region chose other tokens than layer_step")
            ex.model.layer_ops.set_regions(True)
        log.info("round %d/%d done", r + 1, args.rounds)
    records = []
    for (variant, kind, size), t in times.items():
        ratios = [b / a for a, b in zip(t[False], t[True])]
        records.append({"variant": variant, "kind": kind, "size": size, "rounds": args.rounds,
                        "layer_step_ms": round(statistics.median(t[False]), 2),
                        "region_ms": round(statistics.median(t[True]), 2),
                        "region_vs_layer_step": round(statistics.median(ratios), 3),
                        "ratios": [round(x, 3) for x in ratios]})
    print(f"{'variant':10} {'kind':7} {'size':>5} {'layer_step ms':>14} {'region ms':>10} {'region/layer_step':>18}")
    for rec in records:
        print(f"{rec['variant']:10} {rec['kind']:7} {rec['size']:5d} {rec['layer_step_ms']:14.2f} "
              f"{rec['region_ms']:10.2f} {rec['region_vs_layer_step']:18.3f}")
    write_results(args.out, records)


if __name__ == "__main__":
    main()
