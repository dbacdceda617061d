"""Where a batch-1 decode step's time goes, in process: the layer stack, the LM head,
the token choice and everything else, beside the weights each part reads.

For each variant (a dtype or a quantization of the default model) one executor in
this process decodes ``--new-tokens`` greedy tokens after a 32-token prompt, a
``batch_decode`` a step on this thread, and times each step's parts:

- ``stack``: ``model.forward`` (the embedding, every layer, the final norm);
- ``lm_head``: ``model.logits`` (the LM head, float32 logits);
- ``choice``: the token choice over the logits (``engine.choosing.choose``);
- ``rest``: the step less those three (planning, the KV view, commits, the handle:
  Python between two forwards).

The variants take turns: each round probes the read bandwidth (a child process, as
``bench.decode_throughput`` does), then runs every variant once.  Each row keeps the
median of every part over its steps, the parts' read rates (``stack_gbs``: the layers'
weight bytes over the stack's time; ``lm_head_gbs`` likewise), and the median of the
rounds' own step / weight-read ratios (``step_vs_weight_reads``: the step against the
bytes of every linear at that round's probed bandwidth, the floor the batch-1 targets
name).

    .venv/bin/python -m bench.step_parts [--variants float32 bfloat16 w4a8] [--new-tokens 128] [--rounds 5]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections import defaultdict

from bench.common import dtype_and_quantize, log, read_bandwidth_gbs, write_results
from bench.decode_throughput import weight_bytes_per_step
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine import choosing
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.types import DecodeInput, TokenChoice

GREEDY = TokenChoice(temperature=0.0)
PARTS = ("stack", "lm_head", "choice")


class TimedParts:
    """An executor whose stack, LM head and token choice add their time (ns) to ``spent``.
    The token choice is a module function every executor shares: its timer counts only
    while this one's :meth:`decode` runs, and comes off when the context exits."""

    def __init__(self, executor: TorchExecutor):
        self.executor = executor
        self.spent: dict[str, int] = dict.fromkeys(PARTS, 0)
        self.active = False  # this one's decode is running (the shared choice timer counts)
        model = executor.model
        self._timed(model, "forward", "stack")
        self._timed(model, "logits", "lm_head")
        self._untimed_choose = choosing.choose
        self._timed(choosing, "choose", "choice")
        self.weight_bytes = weight_bytes_per_step(model)
        self.head_bytes = weight_bytes_per_step(model.lm_head)

    def _timed(self, owner, name: str, part: str) -> None:
        inner = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.active or owner is not choosing:
                    self.spent[part] += time.perf_counter_ns() - start

        setattr(owner, name, timed)

    def __enter__(self) -> TimedParts:
        return self

    def __exit__(self, *exc) -> None:
        choosing.choose = self._untimed_choose

    def decode(self, prompt: list[int], new_tokens: int) -> list[dict[str, float]]:
        """One greedy run: each step's parts and its whole, ms."""
        ex = self.executor
        self.active = True
        try:
            return self._decode(ex, prompt, new_tokens)
        finally:
            self.active = False

    def _decode(self, ex: TorchExecutor, prompt: list[int], new_tokens: int) -> list[dict[str, float]]:
        first = ex.prefill(prompt, choice=GREEDY)
        token, handle = first.chosen.token_id, first.kv_cache
        steps = []
        for _ in range(new_tokens - 1):
            self.spent = dict.fromkeys(PARTS, 0)
            start = time.perf_counter_ns()
            out = ex.batch_decode([DecodeInput(token, handle, GREEDY)], None)[0]
            whole = time.perf_counter_ns() - start
            token, handle = out.chosen.token_id, out.kv_cache
            step = {part: ns / 1e6 for part, ns in self.spent.items()}
            step["rest"] = (whole - sum(self.spent.values())) / 1e6
            step["step"] = whole / 1e6
            steps.append(step)
        ex.release_cache(handle.cache_id)
        return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["float32", "bfloat16", "w4a8"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="step_parts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = str(prepare_default_model())
    timed = {}
    for variant in args.variants:
        dtype, quantize = dtype_and_quantize(variant)
        config = ExecutorConfig(dtype=dtype, quantize=quantize, kv_tokens=2048)
        timed[variant] = TimedParts(TorchExecutor.from_path(variant, model_dir, config))
        timed[variant].decode([(7 * i + 3) % 4000 + 100 for i in range(32)], 16)  # warm-up
    steps: dict[str, list[dict[str, float]]] = defaultdict(list)
    floors: dict[str, list[float]] = defaultdict(list)
    probes = []
    for r in range(args.rounds):
        probes.append(read_bandwidth_gbs())
        for variant, parts in timed.items():
            prompt = [(17 * i + 5 + 31 * r) % 4000 + 100 for i in range(32)]
            run = parts.decode(prompt, args.new_tokens)
            steps[variant] += run
            floor_ms = parts.weight_bytes / (probes[-1] * 1e9) * 1e3
            floors[variant].append(statistics.median(s["step"] for s in run) / floor_ms)
        log.info("round %d/%d: %.1f GB/s probed", r + 1, args.rounds, probes[-1])
    records = []
    for variant, parts in timed.items():
        median = {key: round(statistics.median(s[key] for s in steps[variant]), 4)
                  for key in (*PARTS, "rest", "step")}
        layer_bytes = parts.weight_bytes - parts.head_bytes
        records.append({
            "variant": variant, "batch": 1, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "ms": median, "weight_bytes": parts.weight_bytes, "lm_head_bytes": parts.head_bytes,
            "stack_gbs": round(layer_bytes / median["stack"] / 1e6, 1),
            "lm_head_gbs": round(parts.head_bytes / median["lm_head"] / 1e6, 1),
            "step_vs_weight_reads": round(statistics.median(floors[variant]), 3),
            "bandwidth_gbs": [round(p, 1) for p in probes]})
    print(f"{'variant':10} {'step ms':>8} {'stack':>7} {'lm_head':>8} {'choice':>7} {'rest':>6} "
          f"{'stack GB/s':>11} {'head GB/s':>10} {'step/floor':>11}")
    for rec in records:
        ms = rec["ms"]
        print(f"{rec['variant']:10} {ms['step']:8.3f} {ms['stack']:7.3f} {ms['lm_head']:8.3f} {ms['choice']:7.3f} "
              f"{ms['rest']:6.3f} {rec['stack_gbs']:11.1f} {rec['lm_head_gbs']:10.1f} {rec['step_vs_weight_reads']:11.3f}")
    print("probed read bandwidth, GB/s:", [round(p, 1) for p in probes])
    write_results(args.out, records)


if __name__ == "__main__":
    main()
