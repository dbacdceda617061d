"""Cost of one token-choice step (server/choice/sampling.py) on B x V float32 rows, side by
side with yardsticks on the same rows: one torch.softmax (a single fused pass), and
a straightforward vLLM-style step (log_softmax for raw logprobs, softmax of the
tempered rows, per-row seeded exponential noise, argmax of probs / noise).

    .venv/bin/python -m bench.sampling [--batch 32] [--vocab 49152] [--threads 1]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from ferrum_rpc.server.choice.sampling import choose_tokens
from ferrum_rpc.types import LogprobsMode, TokenChoice


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _vllm_style(logits: torch.Tensor, temperature: float, generators: list[torch.Generator]) -> torch.Tensor:
    raw = torch.log_softmax(logits, -1)
    probs = torch.softmax(logits / temperature, -1)
    noise = torch.empty_like(probs)
    for row, generator in zip(noise, generators):
        row.exponential_(generator=generator)
    tokens = (probs / noise).argmax(-1)
    return raw.gather(1, tokens.unsqueeze(-1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=49_152)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch, vocab = args.batch, args.vocab
    logits = torch.randn(batch, vocab, generator=torch.Generator().manual_seed(0)) * 3
    positions = list(range(100, 100 + batch))
    cases = {
        "sampling T=0.8 (raw logprob)": [TokenChoice(temperature=0.8, seed=i) for i in range(batch)],
        "sampling T=0.8 (processed logprob)": [
            TokenChoice(temperature=0.8, seed=i, logprobs_mode=LogprobsMode.PROCESSED) for i in range(batch)],
        "sampling T=1": [TokenChoice(seed=i) for i in range(batch)],
        "greedy": [TokenChoice.greedy() for _ in range(batch)],
        "top_k=50 top_p=0.9 T=0.8": [TokenChoice(temperature=0.8, top_k=50, top_p=0.9, seed=i) for i in range(batch)],
        "sampling T=0.8 + 5 top logprobs": [TokenChoice(temperature=0.8, seed=i, top_logprobs=5) for i in range(batch)],
    }
    threads = torch.get_num_threads()
    print(f"{batch} x {vocab} float32, {threads} thread(s), {platform.processor() or platform.machine()}")
    softmax = _median_ms(lambda: torch.softmax(logits, -1), args.repeats)
    print(f"  {'yardstick: torch.softmax':40s} {softmax:7.2f} ms")
    generators = [torch.Generator().manual_seed(i) for i in range(batch)]
    vllm = _median_ms(lambda: _vllm_style(logits, 0.8, generators), args.repeats)
    print(f"  {'yardstick: vLLM-style step T=0.8':40s} {vllm:7.2f} ms")
    for name, choices in cases.items():
        cost = _median_ms(lambda: choose_tokens(logits, choices, positions), args.repeats)
        print(f"  {name:40s} {cost:7.2f} ms  ({cost / softmax:.1f}x softmax, {cost / vllm:.2f}x vLLM-style)")


if __name__ == "__main__":
    main()
