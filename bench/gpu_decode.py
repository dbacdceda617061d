"""Decode throughput on a CUDA device: transformers ``generate`` vs our executor in
process (the worker and executor the server runs, without gRPC) vs through gRPC
(one BatchDecode a step, and decoding ahead with the server choosing the tokens),
side by side in one run on the same GPU.

Greedy, a 32-token prompt and 64 new tokens a sequence by default; output tokens per
second end to end and decode-only (as :mod:`bench.decode_throughput` counts them),
the systems taking turns each round.  Each row's decode step is set against the time
the GPU needs to read the step's weights once (weight bytes / the device's read
bandwidth, probed in this run), and each gRPC row against the in-process one: what
the wire costs a step.

The model is the default one where it is prepared here, else a random checkpoint of
its shape (SmolLM2-135M: 30 layers, 576 wide, 49,152 tokens): speed does not depend
on the weights' values, and a GPU machine may reach no model hub.

    python -m bench.gpu_decode [--batches 1 8 32 64] [--dtypes float32 bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import statistics
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from bench.common import bench_server, log, write_results
from bench.common import read_bandwidth_gbs as cpu_read_bandwidth_gbs
from bench.decode_throughput import (decode_turns, executor_calls, grpc_calls, prompts,
                                     run_grpc_ahead, run_ours, run_transformers, weight_bytes_per_step)
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.server.models import TORCH_DTYPES

# SmolLM2-135M's shape (the embedded default model's config.json).
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1,
                     eos_token_id=2)


# executor-eager: the in-process executor with --cuda-graphs off (every decode step launched op by op)
SYSTEMS = ("transformers", "executor-eager", "executor", "grpc", "grpc-ahead")


def model_dir(given: str | None, scratch: Path) -> str:
    """``given``, else the default model where it is prepared, else a random checkpoint of its shape."""
    if given:
        return given
    from ferrum_rpc.server.prepare import default_model_dir

    prepared = default_model_dir()
    if (prepared / "model.safetensors").exists():
        return str(prepared)
    from transformers import LlamaConfig, LlamaForCausalLM

    log.info("the default model is not prepared here: a random checkpoint of its shape")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)).save_pretrained(scratch / "smollm2-shape")
    return str(scratch / "smollm2-shape")


def read_bandwidth_gbs(device: torch.device, gib: int = 2, repeats: int = 10) -> float:
    """The device's read bandwidth as torch sees it (a sum over a buffer far larger than its
    L2), GB/s: the best of ``repeats``, timed with CUDA events."""
    buf = torch.ones(gib * 2**30 // 4, device=device)
    best = float("inf")
    for _ in range(repeats + 1):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        buf.sum()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del buf
    torch.cuda.empty_cache()
    return gib * 2**30 / best / 1e9


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", help="a checkpoint (default: the default model, else a random one of its shape)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="gpu_decode")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench.gpu_decode: torch sees no CUDA device")
    scratch = Path(tempfile.mkdtemp(prefix="gpu-decode-"))
    path = model_dir(args.model_dir, scratch)
    # (--device cpu: the same rows on the CPU, a check of this script where no GPU is)
    bandwidth = read_bandwidth_gbs(device) if device.type == "cuda" else cpu_read_bandwidth_gbs()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    log.info("%s: read bandwidth %.0f GB/s", name, bandwidth)
    kv_tokens = max(args.batches) * (args.prompt_len + args.new_tokens) * 2 + 1024
    records, kernel_path = [], ""
    for dtype in args.dtypes:
        runners, weight_bytes = {}, {}
        if "transformers" in args.systems:
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(path, dtype=TORCH_DTYPES[dtype]).to(device).eval()
            runners["transformers"] = lambda p, m=hf: run_transformers(m, p, args.new_tokens)
            weight_bytes["transformers"] = weight_bytes_per_step(hf)
        config = ExecutorConfig(dtype=dtype, kv_tokens=kv_tokens, device=args.device, max_batch_size=max(args.batches))
        workers = []
        for system, graphs in (("executor-eager", "off"), ("executor", "auto")):
            if system in args.systems:
                workers.append(ModelWorker(functools.partial(TorchExecutor.from_path, "bench", path,
                                                             replace(config, cuda_graphs=graphs)), "bench",
                                           config.batch_wait_ms))
                weight_bytes[system] = weight_bytes_per_step(workers[-1].loaded.result().model)
                runners[system] = lambda p, c=executor_calls(workers[-1]): run_ours(*c, p, args.new_tokens)
        remote = [s for s in ("grpc", "grpc-ahead") if s in args.systems]
        server = bench_server(path, dtype, kv_tokens, "--device", args.device,
                              "--max-batch", str(max(args.batches))) if remote else None
        client = pool = None
        if server is not None:
            server.wait_serving(600)
            client = ExecutorClient(server.target, timeout=600)
            kernel_path = client.capabilities().kernel_path
            pool = ThreadPoolExecutor(max(args.batches))
            if "grpc" in remote:
                runners["grpc"] = lambda p, c=grpc_calls(client, pool): run_ours(*c, p, args.new_tokens)
            if "grpc-ahead" in remote:
                runners["grpc-ahead"] = lambda p: run_grpc_ahead(client, pool, p, args.new_tokens)
            for system in remote:
                weight_bytes[system] = next(iter(weight_bytes.values()), None)
        try:
            for batch in args.batches:
                batch_prompts = prompts(batch, args.prompt_len)
                for run in runners.values():
                    run(batch_prompts[:1])  # warm-up
                    run(batch_prompts)
                runs, prefills, _, _ = decode_turns(runners, batch_prompts, args.repeats, lambda: None)
                for system in runners:
                    seconds, prefill_s = statistics.median(runs[system]), statistics.median(prefills[system])
                    step_ms = 1e3 * (seconds - prefill_s) / (args.new_tokens - 1)
                    floor_ms = weight_bytes[system] / (bandwidth * 1e9) * 1e3 if weight_bytes.get(system) else None
                    rec = {"kind": "decode", "system": system, "dtype": dtype, "batch": batch,
                           "tokens_per_s": round(batch * args.new_tokens / seconds, 1),
                           "decode_tokens_per_s": round(batch * (args.new_tokens - 1) / (seconds - prefill_s), 1),
                           "step_ms": round(step_ms, 3), "prefill_s": round(prefill_s, 4),
                           "seconds": [round(r, 4) for r in runs[system]], "weight_bytes": weight_bytes.get(system),
                           "weight_read_ms": round(floor_ms, 4) if floor_ms else None,
                           "step_vs_weight_reads": round(step_ms / floor_ms, 2) if floor_ms else None}
                    records.append(rec)
                    log.info("%-12s %-8s batch %3d: %9.1f tokens/s end to end, %9.1f decode-only, %.3f ms a step",
                             system, dtype, batch, rec["tokens_per_s"], rec["decode_tokens_per_s"], step_ms)
        finally:
            if client is not None:
                client.close()
                pool.shutdown()
            if server is not None:
                server.stop()
            for worker in workers:
                worker.stop()
            runners.clear()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        # after each dtype, so that a run cut short keeps what it measured
        write_results(args.out, records, {"device": name, "read_bandwidth_gbs": round(bandwidth, 1), "model": path,
                                          "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                                          "kernel_path": kernel_path})
        print_table(records)


def print_table(records: list[dict]) -> None:
    """Decode-only tokens/s of every system, and the ratios the targets name."""
    by = {(r["system"], r["dtype"], r["batch"]): r for r in records}
    systems = [s for s in SYSTEMS if any(k[0] == s for k in by)]
    print("decode-only tokens/s (step ms)")
    print(f"{'dtype':9} {'batch':>5} " + " ".join(f"{s:>20}" for s in systems)
          + "  ahead/hf  grpc/hf grpc/exec  wire ms  ahead step/floor")
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in records}):
        cells = [by.get((s, dtype, batch)) for s in systems]
        tps = lambda s: by[(s, dtype, batch)]["decode_tokens_per_s"] if (s, dtype, batch) in by else None  # noqa: E731
        ratio = lambda a, b: f"{a / b:8.2f}" if a and b else f"{'-':>8}"  # noqa: E731
        ahead = by.get(("grpc-ahead", dtype, batch))
        print(f"{dtype:9} {batch:5d} "
              + " ".join(f"{c['decode_tokens_per_s']:11.1f} ({c['step_ms']:6.2f})" if c else f"{'-':>20}"
                         for c in cells)
              + f"  {ratio(tps('grpc-ahead'), tps('transformers'))} {ratio(tps('grpc'), tps('transformers'))}"
              + f" {ratio(tps('grpc'), tps('executor'))}"
              + (f" {by[('grpc', dtype, batch)]['step_ms'] - by[('executor', dtype, batch)]['step_ms']:8.3f}"
                 if ('grpc', dtype, batch) in by and ('executor', dtype, batch) in by else f" {'-':>8}")
              + (f"  {ahead['step_vs_weight_reads']:8.2f}" if ahead and ahead["step_vs_weight_reads"] else ""))


if __name__ == "__main__":
    main()
