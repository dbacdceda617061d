"""The C++ client against the Python client: the same seeded decode-ahead generation at
batch 1 through loopback, on the same server in the same run, tokens/s for both.

Both do what ferrum-generate does: Prefill with the token choice (the server chooses
the first token), then one DecodeSession step decoding ahead for the rest; tokens/s
counts the decode-ahead part (tokens after the first over its wall time). The two
clients alternate, `--rounds` times each, and the medians are compared; their token
ids must be equal (same seed). Builds clients/cpp first (the tests' build folder).

    .venv/bin/python -m bench.cpp_client [--tokens 128] [--rounds 5] [--model-dir DIR]

Default: the embedded SmolLM2-135M (prepared as `make prepare` does), float32.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time

from bench.common import served, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.types import TokenChoice

log = logging.getLogger("bench.cpp_client")
PROMPT = [1, 504, 3458, 282, 2260, 314, 4649, 30, 198, 1206, 2251, 314]  # 12 ids under SmolLM2's vocab
CHOICE = dict(temperature=0.8, top_k=40, top_p=0.9, seed=7)


def python_run(ex: ExecutorClient, max_tokens: int) -> tuple[list[int], float]:
    choice = TokenChoice(**CHOICE)
    out = ex.prefill(PROMPT, token_choice=choice)
    t0 = time.perf_counter()
    run = ex.decode_ahead(out.chosen.token_id, out.kv_cache, choice, max_tokens - 1)
    seconds = time.perf_counter() - t0
    ex.release_cache(run.kv_cache)
    return [out.chosen.token_id] + [c.token_id for c in run.chosen], seconds


def cpp_run(binary: str, target: str, max_tokens: int) -> tuple[list[int], float]:
    args = [binary, "--target", target, "--tokens", ",".join(map(str, PROMPT)), "--max-tokens", str(max_tokens)]
    for name, value in CHOICE.items():
        args += ["--" + name.replace("_", "-"), str(value)]
    done = subprocess.run(args, capture_output=True, text=True, check=True)
    timing = json.loads(done.stderr.strip().splitlines()[-1])
    return [int(t) for t in done.stdout.split()], timing["ahead_s"]


def cpu() -> dict:
    info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True)
                .stdout.splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16")
    return {"model": info.get("Model name", "").strip(), "cpus": info.get("CPU(s)", "").strip(),
            "flags": [f for f in wanted if f in flags]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model-dir", default="")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    from tests.contract.test_cpp_client import build_dir, cpp_bin_path  # the tests' build, reused
    binary = str(cpp_bin_path(optimized=True) / "ferrum-generate")
    if args.model_dir:
        model_dir = args.model_dir
    else:
        from ferrum_rpc.server.prepare import prepare_default_model
        model_dir = str(prepare_default_model())
    log.info("C++ build: %s", build_dir(optimized=True))

    py_s, cpp_s = [], []
    with served(model_dir, args.dtype) as target, ExecutorClient(target, timeout=120) as ex:
        python_run(ex, 8), cpp_run(binary, target, 8)  # warm both paths
        for _ in range(args.rounds):
            py_ids, s = python_run(ex, args.tokens)
            py_s.append(s)
            cpp_ids, s = cpp_run(binary, target, args.tokens)
            cpp_s.append(s)
            assert cpp_ids == py_ids, "the C++ and Python clients chose different tokens"
    n = args.tokens - 1
    record = {"tokens": args.tokens, "rounds": args.rounds, "model": model_dir, "dtype": args.dtype,
              "python_tokens_per_s": n / statistics.median(py_s), "cpp_tokens_per_s": n / statistics.median(cpp_s),
              "python_runs_s": py_s, "cpp_runs_s": cpp_s, "cpu": cpu()}
    record["cpp_over_python"] = record["cpp_tokens_per_s"] / record["python_tokens_per_s"]
    print(f"decode-ahead at batch 1, {n} tokens, median of {args.rounds}: "
          f"Python {record['python_tokens_per_s']:.1f} tok/s, C++ {record['cpp_tokens_per_s']:.1f} tok/s "
          f"(x{record['cpp_over_python']:.3f}); CPU {record['cpu']['model']} {record['cpu']['flags']}")
    write_results("cpp_client", [record])


if __name__ == "__main__":
    sys.exit(main())
