"""Decode throughput of the default model: transformers generate vs our executor
in-process (the model worker and executor the server runs, without gRPC) vs our
executor through gRPC, side by side in one run.

Prompt 32 tokens, 64 new tokens, greedy; output tokens per second end to end
(prefill included, as a user sees it: a batch's prompts are sent together and
share forwards) and decode-only (the prefill part
subtracted: for transformers, the same generate call stopped after one
token), each figure the median of several runs.

Variants: ``float32``, ``bfloat16``, ``int8`` / ``int4`` (our weight-only
``--quantize``, float32 activations) and ``w8a8`` / ``w4a8`` (the same weights,
activations quantized to int8 per block and multiplied in integers); the
quantized variants' transformers reference is float32.
``llama.cpp`` runs the same GGUF file at every batch size (its batch API, one
``llama_decode`` a step over all sequences) from its own cached environment (``python -m bench.llama_cpp --setup`` builds it once); it is
skipped, with a log line, where that environment is missing.  Each gRPC row
also splits the decode step into weight-read time (weight bytes a step reads /
memory read bandwidth probed right before that variant and batch) and the rest, and reports the
server process's resident memory after the run and at its peak (loading included).

    python -m bench.decode_throughput [--batches 1 8 32] [--dtypes float32 bfloat16 int8 int4 w8a8 w4a8]
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from bench import llama_cpp
from bench.common import RSS_MB, log, median_of, read_bandwidth_gbs, served, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.config import QUANTIZATIONS, ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.models import TORCH_DTYPES
from ferrum_rpc.server.prepare import find_gguf, prepare_default_model
from ferrum_rpc.server.kernels.woq import QuantizedLinear
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.types import DecodeInput, LogitsPolicy, TokenChoice

GREEDY = LogitsPolicy.argmax()
PREFILL_SECONDS: list[float] = []  # prefill part of each run of ours, for the decode-only figure


def prompts(batch: int, length: int) -> list[list[int]]:
    return [[1 + (7 * b + 13 * i) % 4000 for i in range(length)] for b in range(batch)]


def run_ours(prefill_all, batch_decode, release, batch_prompts: list[list[int]], new_tokens: int) -> float:
    """Greedy generation through our contract (in-process executor or gRPC client): seconds."""
    start = time.perf_counter()
    outs = prefill_all(batch_prompts)
    PREFILL_SECONDS.append(time.perf_counter() - start)
    handles = [o.kv_cache for o in outs]
    tokens = [o.logits.argmax()[0] for o in outs]
    for _ in range(new_tokens - 1):
        steps = batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)])
        handles = [s.kv_cache for s in steps]
        tokens = [s.logits.argmax()[0] for s in steps]
    elapsed = time.perf_counter() - start
    for h in handles:
        release(h.cache_id)
    return elapsed


def run_executor(worker: ModelWorker, batch_prompts: list[list[int]], new_tokens: int) -> float:
    """In process, through the worker entry points the servicer's handlers use."""
    def prefill_all(prompts):  # submitted together, as BatchPrefill does: their parts share forwards
        return [f.result() for f in [worker.submit_prefill(p, None, GREEDY) for p in prompts]]

    def release(cache_id):
        return worker.submit(worker.executor.release_cache, cache_id).result()

    return run_ours(prefill_all, lambda items: worker.submit_decode(items, GREEDY).result(), release,
                    batch_prompts, new_tokens)


def run_grpc(client: ExecutorClient, pool: ThreadPoolExecutor, batch_prompts: list[list[int]],
             new_tokens: int) -> float:
    def prefill_all(prompts):  # sent together; the server batches them
        return list(pool.map(lambda p: client.prefill(p, logits=GREEDY), prompts))

    return run_ours(prefill_all, lambda items: client.batch_decode(items, GREEDY), client.release_cache,
                    batch_prompts, new_tokens)


def run_grpc_ahead(client: ExecutorClient, pool: ThreadPoolExecutor, batch_prompts: list[list[int]],
                   new_tokens: int) -> float:
    """Through gRPC with the server choosing the tokens (greedy) and decoding ahead: after
    the prompt, one DecodeSession step per sequence streams the other new tokens."""
    start = time.perf_counter()
    outs = list(pool.map(lambda p: client.prefill(p, logits=GREEDY), batch_prompts))
    PREFILL_SECONDS.append(time.perf_counter() - start)
    greedy = TokenChoice(temperature=0.0)
    ends = list(pool.map(lambda o: client.decode_ahead(o.logits.argmax()[0], o.kv_cache, greedy, new_tokens - 1),
                         outs))
    elapsed = time.perf_counter() - start
    assert all(len(e.chosen) == new_tokens - 1 for e in ends)
    for e in ends:
        client.release_cache(e.kv_cache)
    return elapsed


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of linear weights one decode step reads (every projection and the LM head)."""
    total = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear) or type(module).__name__ == "FastLinear":
            total += module.nbytes
        elif isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
    return total


def run_llama_cpp(batch: int, args) -> dict | None:
    exe = llama_cpp.python()
    if exe is None:
        log.info("llama.cpp skipped: build its environment once with python -m bench.llama_cpp --setup")
        return None
    import json
    import os
    import subprocess
    from pathlib import Path

    cmd = [str(exe), "-m", "bench.llama_cpp", "--run", "--gguf", str(find_gguf()), "--batch", str(batch),
           "--prompt-len", str(args.prompt_len), "--new-tokens", str(args.new_tokens),
           "--repeats", str(args.repeats), "--threads", str(torch.get_num_threads())]
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    if done.returncode:
        log.warning("llama.cpp failed: %s", done.stderr[-500:])
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_transformers(model, batch_prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch_prompts)
    if new_tokens > 1:  # the prefill part: the same call stopping after its first token
        PREFILL_SECONDS.append(run_transformers(model, batch_prompts, 1))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--systems", nargs="+", default=["transformers", "executor", "grpc", "llama.cpp"],
                        help="also grpc-ahead: the server chooses greedy tokens and decodes ahead")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="decode_throughput")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = str(prepare_default_model())
    records = []
    bandwidth = 0.0

    def probe_bandwidth(before: str) -> None:
        """The read-bandwidth probe again, right before each variant's runs, as the
        median of three child processes: on this VM one probe reads 26-40 GB/s or,
        now and then, 58-63 (the buffer's pages, not the minute: three probes in a
        row differ so), and each weight-read share is taken against the probes
        nearest its runs."""
        nonlocal bandwidth
        probes = sorted(read_bandwidth_gbs() for _ in range(3))
        bandwidth = probes[1]
        log.info("memory read bandwidth before %s: %.1f GB/s (probes %s)", before, bandwidth,
                 " ".join(f"{p:.1f}" for p in probes))

    def record(system, dtype, batch, seconds, runs, prefill_s, **extra):
        tps = batch * args.new_tokens / seconds
        decode_tps = batch * (args.new_tokens - 1) / (seconds - prefill_s)
        rec = {"system": system, "dtype": dtype, "batch": batch, "tokens_per_s": round(tps, 2),
               "decode_tokens_per_s": round(decode_tps, 2), "prefill_s": round(prefill_s, 4),
               "seconds": [round(r, 4) for r in runs], "new_tokens": args.new_tokens,
               "prompt_len": args.prompt_len, "bandwidth_gbs": round(bandwidth, 2)}
        if "weight_bytes" in extra:
            step_ms = 1e3 * (seconds - prefill_s) / (args.new_tokens - 1)
            weight_ms = extra["weight_bytes"] / (bandwidth * 1e9) * 1e3
            extra.update(step_ms=round(step_ms, 2), weight_read_ms=round(weight_ms, 2),
                         rest_fraction=round(1 - weight_ms / step_ms, 3))
        rec.update(extra)
        records.append(rec)
        log.info("%-12s %-8s batch %3d: %8.1f tokens/s end to end, %8.1f decode-only %s",
                 system, dtype, batch, tps, decode_tps, extra or "")

    for batch in args.batches if "llama.cpp" in args.systems else []:
        probe_bandwidth(f"llama.cpp batch {batch}")
        if (out := run_llama_cpp(batch, args)) is not None:
            gguf_bytes = find_gguf().stat().st_size  # every tensor is read once a step (the head is the embedding)
            record("llama.cpp", "Q4_1", batch, out["seconds"], out["runs"], out["prefill_s"],
                   weight_bytes=gguf_bytes, rss_mb=round(out["rss_mb"], 1), peak_rss_mb=round(out["peak_rss_mb"], 1))

    for variant in args.dtypes:
        dtype, quantize = ("float32", variant) if variant in QUANTIZATIONS else (variant, "none")
        runners, weight_bytes, worker = {}, None, None
        remote = {"grpc", "grpc-ahead"} & set(args.systems)
        if "transformers" in args.systems and quantize == "none":
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()
            runners["transformers"] = lambda p, m=hf: run_transformers(m, p, args.new_tokens)
        if "executor" in args.systems or remote:  # the in-process one also counts weight bytes
            config = ExecutorConfig(dtype=dtype, kv_tokens=32768, quantize=quantize)
            worker = ModelWorker(functools.partial(TorchExecutor.from_path, "bench", model_dir, config), "bench",
                                 config.batch_wait_ms)  # loads on its own thread, as the server does
            ex = worker.loaded.result()
            weight_bytes, kv_mb = weight_bytes_per_step(ex.model), ex.pool.nbytes / 2**20
            if "executor" in args.systems:
                runners["executor"] = lambda p, w=worker: run_executor(w, p, args.new_tokens)
        extra = ("--quantize", quantize)
        with served(model_dir, dtype, extra) if remote else _null() as target:
            if target:
                client = ExecutorClient(target, timeout=600)
                pool = ThreadPoolExecutor(max(args.batches))
                if "grpc" in args.systems:
                    runners["grpc"] = lambda p, c=client: run_grpc(c, pool, p, args.new_tokens)
                if "grpc-ahead" in args.systems:
                    runners["grpc-ahead"] = lambda p, c=client: run_grpc_ahead(c, pool, p, args.new_tokens)
            for batch in args.batches:
                batch_prompts = prompts(batch, args.prompt_len)
                probe_bandwidth(f"{variant} batch {batch}")
                for system, run in runners.items():
                    run(batch_prompts[:1])  # warm-up
                    PREFILL_SECONDS.clear()
                    seconds, runs = median_of(args.repeats, lambda: run(batch_prompts))
                    split = ({"weight_bytes": weight_bytes, "kv_pool_mb": round(kv_mb, 1)}
                             if system in ("grpc", "executor") and weight_bytes else {})
                    record(system, variant, batch, seconds, runs, statistics.median(PREFILL_SECONDS), **split)
        if target in RSS_MB:
            for rec in records:
                if rec["system"] == "grpc" and rec["dtype"] == variant:
                    rec["rss_mb"] = round(RSS_MB[target]["VmRSS"], 1)
                    rec["peak_rss_mb"] = round(RSS_MB[target]["VmHWM"], 1)
        runners.clear()
        if worker is not None:
            worker.stop()
    write_results(args.out, records)
    print_table(records)
    print_table(records, "decode_tokens_per_s")
    from bench.report import step_table

    print(step_table(records))


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def print_table(records: list[dict], key: str = "tokens_per_s") -> None:
    print(f"output tokens/s ({key}):")
    by_key = {(r["system"], r["dtype"], r["batch"]): r[key] for r in records}
    systems = sorted({r["system"] for r in records})
    print(f"{'dtype':9} {'batch':>5} " + " ".join(f"{s:>13}" for s in systems) + "  grpc/exec  grpc/hf")
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in records}):
        row = [by_key.get((s, dtype, batch)) for s in systems]
        g, e, h = (by_key.get((s, dtype, batch)) for s in ("grpc", "executor", "transformers"))
        ratio = lambda a, b: f"{a / b:9.2f}" if a and b else f"{'-':>9}"
        print(f"{dtype:9} {batch:5d} " + " ".join(f"{v:13.1f}" if v else f"{'-':>13}" for v in row)
              + f" {ratio(g, e)} {ratio(g, h)}")


if __name__ == "__main__":
    main()
