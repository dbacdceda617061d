"""Ferrum's own engine through the server against the Python client, in one run on one
server: ferrum-engine-generate (Ferrum's ContinuousEngine with RemoteExecutor, greedy:
the server chooses each token under Ferrum's token mask, decoding ahead under the
engine, whose steps are answered from the streamed tokens) and the Python client's
generate_ids (greedy, its default path: the server chooses the tokens, decoding ahead
where it can), at 1 and at 8 concurrent requests; and as a third column
ferrum-own-generate: the same ContinuousEngine on Ferrum's own in-process CPU executor
(its registry's "llm" executor, LlamaFamilyModel on its CpuBackend), loading the same
model folder, with no server.

Per side and concurrency: time to first token (median over requests, measured from
each request's submission; the engine's startup is outside it) and decode tokens/s
(every request's tokens after its first, over the time from the first request's first
token to the last request's end). The engine's token ids through the server must
equal generate_ids'; Ferrum's own executor is a different implementation of the model,
whose float differences may flip a greedy choice, so for it the bench records how many
prompts' ids equal generate_ids' and the shortest common prefix, rather than requiring
equality.

    .venv/bin/python -m bench.ferrum_engine [--tokens 64] [--rounds 3]

Builds clients/rust (the tests' cargo target folder) first.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import served, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.sampling import SamplingParams

log = logging.getLogger("bench.ferrum_engine")
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at",
           "The three primary colors are", "In 1969, humans", "A haiku about rain:", "Rust is a language that"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def summary(runs: list[tuple[list[int], float, float, float]]) -> dict:
    """runs: (ids, start, first token, end) per request, times in seconds on one clock."""
    first = min(r[2] for r in runs)
    end = max(r[3] for r in runs)
    decoded = sum(len(r[0]) - 1 for r in runs)
    return {"ttft_s": statistics.median(r[2] - r[1] for r in runs), "decode_tokens_per_s": decoded / (end - first)}


def engine_run(binary: Path, target: str, tokenizer: Path, prompts: list[str], n: int) -> tuple[list, dict]:
    done = subprocess.run([str(binary), "--addr", target, "--max-tokens", str(n), "--concurrency", str(len(prompts)),
                           "--tokenizer", str(tokenizer), "--ids", "--timing", *prompts],
                          capture_output=True, text=True, check=True, timeout=600)
    out = done.stdout.splitlines()
    timing = json.loads(out[-1].split(" ", 1)[1])
    ids = [[int(t) for t in line.split()] for line in out[:-1]]
    # The program times each request from its own submission (all submitted at once).
    runs = [(i, 0.0, t["ttft_s"], t["total_s"]) for i, t in zip(ids, timing)]
    return ids, summary(runs)


def own_run(binary: Path, model_dir: Path, prompts: list[str], n: int) -> tuple[list, dict]:
    """ferrum-own-generate over the model folder; its model load is startup, outside the times."""
    done = subprocess.run([str(binary), "--model", str(model_dir), "--max-tokens", str(n), "--concurrency",
                           str(len(prompts)), "--ids", "--timing", *prompts],
                          capture_output=True, text=True, check=True, timeout=600)
    out = done.stdout.splitlines()
    timing = json.loads(out[-1].split(" ", 1)[1])
    ids = [[int(t) for t in line.split()] for line in out[:-1]]
    runs = [(i, 0.0, t["ttft_s"], t["total_s"]) for i, t in zip(ids, timing)]
    return ids, summary(runs)


def agreement(own: list[list[int]], python: list[list[int]]) -> dict:
    """How far Ferrum's own executor's greedy ids follow generate_ids' (which also yields
    the EOS id the engine stops at without emitting): prompts equal over the engine's
    tokens, and the shortest common prefix."""
    prefix = [next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
              for a, b in zip(own, python)]
    return {"equal": sum(a == b[:len(a)] for a, b in zip(own, python)), "prompts": len(own),
            "min_common_prefix": min(prefix)}


def python_run(target: str, prompt_ids: list[list[int]], n: int) -> tuple[list, dict]:
    runs: list = [None] * len(prompt_ids)
    start = threading.Barrier(len(prompt_ids))

    def one(k: int) -> None:
        with ExecutorClient(target, timeout=600) as c:
            start.wait()
            t0 = time.perf_counter()
            got, first = [], None
            for t in generate_ids(c, prompt_ids[k], n, SamplingParams(greedy=True)):
                first = first or time.perf_counter()
                got.append(t)
            runs[k] = (got, t0, first, time.perf_counter())

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompt_ids))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r[0] for r in runs], summary(runs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    import pytest  # noqa: F401  (the tests' module imports it)
    from tokenizers import Tokenizer

    from ferrum_rpc.server.prepare import prepare_default_model
    from tests.contract.test_rust_client import CRATE, target_dir
    subprocess.run(["cargo", "build", "--release", "--bins", "--examples"], cwd=CRATE, check=True,
                   env={**__import__("os").environ, "CARGO_TARGET_DIR": str(target_dir()),
                        "FERRUM_PYTHON": sys.executable})
    binary = target_dir() / "release" / "ferrum-engine-generate"
    own_binary = target_dir() / "release" / "ferrum-own-generate"
    model_dir = Path(prepare_default_model())
    tokenizer = model_dir / "tokenizer.json"
    tok = Tokenizer.from_file(str(tokenizer))
    records = []
    with served(str(model_dir), "float32") as target:
        engine_run(binary, target, tokenizer, PROMPTS[:1], 4)  # warm both paths
        python_run(target, [tok.encode(PROMPTS[0]).ids], 4)
        own_run(own_binary, model_dir, PROMPTS[:1], 4)
        for k in (1, 8):
            prompts = PROMPTS[:k]
            prompt_ids = [tok.encode(p).ids for p in prompts]
            eng, py, own = [], [], []
            for _ in range(args.rounds):
                e_ids, e = engine_run(binary, target, tokenizer, prompts, args.tokens)
                p_ids, p = python_run(target, prompt_ids, args.tokens)
                o_ids, o = own_run(own_binary, model_dir, prompts, args.tokens)
                # generate_ids stops at no id here, the engine at EOS: compare the common part.
                for a, b in zip(e_ids, p_ids):
                    assert a == b[:len(a)], "the engine and the Python client chose different tokens"
                eng.append(e)
                py.append(p)
                own.append({**o, "agreement": agreement(o_ids, p_ids)})
            med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
            rec = {"concurrency": k, "tokens": args.tokens, "rounds": args.rounds,
                   "engine_ttft_s": med(eng, "ttft_s"), "engine_decode_tokens_per_s": med(eng, "decode_tokens_per_s"),
                   "python_ttft_s": med(py, "ttft_s"), "python_decode_tokens_per_s": med(py, "decode_tokens_per_s"),
                   "own_ttft_s": med(own, "ttft_s"), "own_decode_tokens_per_s": med(own, "decode_tokens_per_s"),
                   "engine_runs": eng, "python_runs": py, "own_runs": own}
            records.append(rec)
            agree = own[-1]["agreement"]
            print(f"concurrency {k}: Ferrum engine {rec['engine_decode_tokens_per_s']:.1f} tok/s, "
                  f"TTFT {rec['engine_ttft_s'] * 1e3:.0f} ms; Python generate_ids "
                  f"{rec['python_decode_tokens_per_s']:.1f} tok/s, TTFT {rec['python_ttft_s'] * 1e3:.0f} ms; "
                  f"Ferrum's own executor {rec['own_decode_tokens_per_s']:.1f} tok/s, "
                  f"TTFT {rec['own_ttft_s'] * 1e3:.0f} ms (ids equal generate_ids' for "
                  f"{agree['equal']}/{agree['prompts']} prompts)")
    write_results("ferrum_engine", records, {"cpu": cpu_model(), "model": str(model_dir)})


if __name__ == "__main__":
    sys.exit(main())
