"""llama.cpp on the same GGUF file, as the batch-1 anchor for bench.decode_throughput.

llama-cpp-python compiles llama.cpp for several minutes, so it lives in its own
cached environment, built once:

    python -m bench.llama_cpp --setup        # creates $FERRUM_RPC_HOME/llama-cpp-venv
    <that venv>/bin/python -m bench.llama_cpp --run --batch 1 ...   # what decode_throughput calls

``--run`` prints one JSON record per line (greedy, the same prompts as ours).
It needs nothing from ferrum_rpc, so it runs in that environment alone.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

VERSION = "0.3.36"


def venv_dir() -> Path:
    home = Path(os.environ.get("FERRUM_RPC_HOME", Path.home() / ".cache" / "ferrum-rpc"))
    return home / "llama-cpp-venv"


def python() -> Path | None:
    exe = venv_dir() / "bin" / "python"
    return exe if exe.exists() else None


def setup() -> None:
    target = venv_dir()
    print(f"building llama-cpp-python {VERSION} into {target} (compiles llama.cpp; several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    subprocess.run([str(target / "bin" / "pip"), "install", f"llama-cpp-python=={VERSION}"], check=True)
    print("done", flush=True)


def run(gguf: str, batch: int, prompt_len: int, new_tokens: int, repeats: int, threads: int) -> None:
    import numpy as np
    from llama_cpp import Llama

    if batch != 1:
        raise SystemExit("only batch 1 is measured for llama.cpp")
    llm = Llama(model_path=gguf, n_ctx=prompt_len + new_tokens + 8, n_threads=threads, n_threads_batch=threads,
                n_batch=512, verbose=False)
    prompt = [1 + (13 * i) % 4000 for i in range(prompt_len)]  # bench.decode_throughput.prompts(1, n)[0]

    def once() -> tuple[float, float]:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        prefill = time.perf_counter() - start
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return time.perf_counter() - start, prefill

    once()  # warm-up
    runs = sorted((once() for _ in range(repeats)), key=lambda r: r[0])
    seconds, prefill = runs[len(runs) // 2]
    print(json.dumps({"seconds": seconds, "prefill_s": prefill, "runs": [r[0] for r in runs],
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true")
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--gguf")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    if args.setup:
        setup()
    if args.run:
        run(args.gguf, args.batch, args.prompt_len, args.new_tokens, args.repeats, args.threads)


if __name__ == "__main__":
    main()
