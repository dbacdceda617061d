"""llama.cpp on the same GGUF file, the anchor for bench.decode_throughput (batch 1, 8, 32).

llama-cpp-python compiles llama.cpp for several minutes, so it lives in its own
cached environment, built once:

    python -m bench.llama_cpp --setup        # creates $FERRUM_RPC_HOME/llama-cpp-venv
    <that venv>/bin/python -m bench.llama_cpp --run --batch 8 ...   # what decode_throughput calls

``--run`` prints one JSON record per line (greedy, the same prompts as ours);
``--argmax --ids '[...]'`` prints the next-token argmax at every position of
those token ids (teacher-forced, for bench.quant_accuracy).
It needs nothing from ferrum_rpc, so it runs in that environment alone.
"""

from __future__ import annotations

import argparse
import json
import os
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
    """Greedy generation of ``batch`` sequences through llama.cpp's batch API: the
    prompts in one ``llama_decode`` (one sequence id each), then one ``llama_decode``
    a step carrying every sequence's next token, as our executor's batched step does."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    params = L.llama_context_default_params()
    params.n_ctx = batch * (prompt_len + new_tokens + 8)
    params.n_batch = params.n_ubatch = max(batch * prompt_len, 512)
    params.n_seq_max = batch
    params.kv_unified = True  # one KV buffer shared by the sequences, as our pool is
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    tokens = L.llama_batch_init(batch * prompt_len, 0, 1)
    # bench.decode_throughput.prompts(batch, prompt_len): the same token ids as ours
    prompts = [[1 + (7 * b + 13 * i) % 4000 for i in range(prompt_len)] for b in range(batch)]

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over (token, position, sequence, wants logits); greedy next tokens."""
        tokens.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            tokens.token[i], tokens.pos[i], tokens.n_seq_id[i], tokens.logits[i] = token, pos, 1, wants
            tokens.seq_id[i][0] = seq
        if (rc := L.llama_decode(ctx, tokens)) != 0:
            raise SystemExit(f"llama_decode failed: {rc}")
        return [int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i, entry in enumerate(entries) if entry[3]]

    def once() -> tuple[float, float]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        start = time.perf_counter()
        nexts = decode([(t, i, s, i == prompt_len - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        prefill = time.perf_counter() - start
        for step in range(new_tokens - 1):
            nexts = decode([(t, prompt_len + step, s, True) for s, t in enumerate(nexts)])
        return time.perf_counter() - start, prefill

    once()  # warm-up
    runs = sorted((once() for _ in range(repeats)), key=lambda r: r[0])
    seconds, prefill = runs[len(runs) // 2]
    resident = {"rss_mb": resident_mb("VmRSS"), "peak_rss_mb": resident_mb("VmHWM")}  # model and context alive
    L.llama_batch_free(tokens)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"seconds": seconds, "prefill_s": prefill, "runs": [r[0] for r in runs],
                      **resident}))


def argmax_all(gguf: str, ids: list[int], threads: int) -> None:
    """The argmax of llama.cpp's logits at every position of ``ids``, one ``llama_decode``."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = len(ids) + 8
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(len(ids), 0, 1)
    batch.n_tokens = len(ids)
    for i, token in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
        batch.seq_id[i][0] = 0
    if (rc := L.llama_decode(ctx, batch)) != 0:
        raise SystemExit(f"llama_decode failed: {rc}")
    print(json.dumps([int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                      for i in range(len(ids))]))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


def resident_mb(key: str) -> float:
    """This process's resident set now (VmRSS) or at its peak (VmHWM), MiB; VmHWM starts
    afresh at exec (getrusage's ru_maxrss does not: it would report the forking benchmark's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true")
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--argmax", action="store_true")
    parser.add_argument("--ids", help="JSON list of token ids, for --argmax")
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
    if args.argmax:
        argmax_all(args.gguf, json.loads(args.ids), args.threads)


if __name__ == "__main__":
    main()
