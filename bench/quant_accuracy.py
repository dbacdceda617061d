"""Greedy top-1 agreement of each ``--quantize`` mode with float32 on the real
default model: a fixed English text (tests/data/english.txt), teacher-forced,
the next-token argmax at every one of its first N positions (1,000 by
default), computed in process by the executor the server runs.  Optionally
llama.cpp's own agreement with our float32 on the same positions (its logits
for every position of the same token ids, from its cached environment).

    python -m bench.quant_accuracy [--modes int8 int4 w8a8 w4a8] [--positions 1000] [--llama-cpp]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
from pathlib import Path

import numpy as np

from bench import llama_cpp
from bench.common import log
from ferrum_rpc.client.generate import load_tokenizer
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.executor import TorchExecutor
from ferrum_rpc.server.prepare import find_gguf, prepare_default_model
from ferrum_rpc.types import LogitsPolicy

ROOT = Path(__file__).resolve().parent.parent


def english_ids(model_dir: Path, positions: int) -> list[int]:
    ids = load_tokenizer(model_dir)((ROOT / "tests" / "data" / "english.txt").read_text())["input_ids"]
    if len(ids) < positions + 1:
        raise SystemExit(f"english.txt has {len(ids)} tokens, fewer than {positions + 1}")
    return ids[:positions + 1]


def argmaxes(model_dir: Path, quantize: str, ids: list[int]) -> np.ndarray:
    """Next-token argmax at each of ``ids``' positions, one chunked prefill."""
    ex = TorchExecutor.from_path("acc", model_dir, ExecutorConfig(quantize=quantize, kv_tokens=4096))
    out = ex.prefill(ids, None, LogitsPolicy.argmax(all_positions=True))
    return np.asarray(out.logits.argmax())


def llama_cpp_argmaxes(ids: list[int]) -> np.ndarray | None:
    exe = llama_cpp.python()
    if exe is None:
        log.info("llama.cpp skipped: build its environment once with python -m bench.llama_cpp --setup")
        return None
    cmd = [str(exe), "-m", "bench.llama_cpp", "--argmax", "--gguf", str(find_gguf()), "--ids", json.dumps(ids)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if done.returncode:
        log.warning("llama.cpp failed: %s", done.stderr[-500:])
        return None
    return np.asarray(json.loads(done.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--positions", type=int, default=1000)
    parser.add_argument("--llama-cpp", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = prepare_default_model()
    ids = english_ids(model_dir, args.positions)
    reference = argmaxes(model_dir, "none", ids)[:args.positions]
    results = {}
    for mode in args.modes:
        results[mode] = float((argmaxes(model_dir, mode, ids)[:args.positions] == reference).mean())
    if args.llama_cpp and (theirs := llama_cpp_argmaxes(ids)) is not None:
        results["llama.cpp Q4_1"] = float((theirs[:args.positions] == reference).mean())
    print(f"greedy top-1 agreement with float32 over {args.positions} positions of tests/data/english.txt:")
    for mode, agreement in results.items():
        print(f"  {mode:15} {agreement:.2%}")


if __name__ == "__main__":
    main()
