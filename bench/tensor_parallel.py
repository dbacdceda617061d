"""Tensor parallelism's cost on this machine: decode tokens/s at batch 1
and 32 for degree 1, 2 and 3, with the time each forward spends in the layers'
all-reduces and in the LM head's reduction, as the server counts them.

The model is SmolLM2-135M's shape (hidden 576, 30 layers, MLP 1536, vocabulary
49,152, tied embeddings) with 12 heads and 6 KV heads instead of 9 and 3, so 1, 2
and 3 all divide it; random float32 weights (only time is measured).  Every run is
its own server process (``--no-warmup``): batch 1 is one 16-token prompt then
``--steps`` ARGMAX decodes; batch 32 is one BatchPrefill of 32 prompts then
``--steps`` BatchDecode calls.  ``--modes choice`` decodes with a server-side token
choice instead (seeded, temperature 0.8, top-k 50: each rank's 51 candidates merged,
no whole rows; see ``server/parallel/choice.py``; a top-p would gather whole rows here, as
random weights give near-uniform rows whose nucleus is wider than 256 tokens).  The server's own count (logged
when it stops) divides all-reduce time, LM-head time and the bytes the LM head
gathered by its forwards, the prefill forward included.  First, a
micro-benchmark: gloo all-reduce of 8 KiB, 64 KiB and 4 MiB between 2 and 3
processes over loopback (latency and bandwidth for the README's estimates).

    .venv/bin/python -m bench.tensor_parallel [--degrees 1 2 3] [--steps 32] [--modes argmax choice]
"""

from __future__ import annotations

import argparse
import platform
import re
import tempfile
import time

import torch

from bench.common import log, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.harness import ServerProcess
from ferrum_rpc.types import DecodeInput, LogitsPolicy, TokenChoice

SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
             num_attention_heads=12, num_key_value_heads=6, max_position_embeddings=2048,
             tie_word_embeddings=True)
STATS = re.compile(r"tensor parallel: (\d+) forwards, ([\d.]+) ms a forward in all-reduces, ([\d.]+) ms in the LM"
                   r".*?([\d.]+) bytes a forward gathered by the LM head, (\d+) token-choice rows on whole")
CHOICE = TokenChoice(temperature=0.8, top_k=50, seed=1)


def make_model(folder: str) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**SHAPE)).eval().save_pretrained(folder)
    return folder


def run(folder: str, degree: int, batch: int, steps: int, mode: str = "argmax") -> dict:
    flags = ["--kv-tokens", "8192", "--no-warmup", "--max-batch", "64"]
    if degree > 1:
        flags += ["--tensor-parallel", str(degree)]
    with ServerProcess(f"bench={folder}", *flags) as server:
        server.wait_serving(600)
        with ExecutorClient(server.target, timeout=600) as ex:
            prompts = [[(7 * b + i) % 49000 + 1 for i in range(16)] for b in range(batch)]
            outs = ex.batch_prefill(prompts, logits=LogitsPolicy.argmax()) if batch > 1 else \
                [ex.prefill(prompts[0], logits=LogitsPolicy.argmax())]
            handles = [o.kv_cache for o in outs]
            t0 = time.perf_counter()
            for _ in range(steps):
                handles = _step(ex, handles, mode)
            seconds = time.perf_counter() - t0
        server.stop()
        stats = STATS.search(server.log())
    record = {"degree": degree, "batch": batch, "mode": mode, "steps": steps, "tokens_per_s": batch * steps / seconds,
              "step_ms": 1000 * seconds / steps}
    if stats:
        record.update(forwards=int(stats[1]), allreduce_ms_per_forward=float(stats[2]),
                      lm_head_reduce_ms_per_forward=float(stats[3]), lm_head_bytes_per_forward=float(stats[4]),
                      choice_rows_on_whole_rows=int(stats[5]))
    log.info("%s", record)
    return record


def _step(ex, handles, mode: str) -> list:
    """One decode of every sequence: ARGMAX logits back, or a token chosen on the server."""
    if mode == "choice":
        outs = ex.batch_decode([DecodeInput(1, h, CHOICE) for h in handles])
    elif len(handles) == 1:
        outs = [ex.decode(1, handles[0], LogitsPolicy.argmax())]
    else:
        outs = ex.batch_decode([DecodeInput(1, h) for h in handles], LogitsPolicy.argmax())
    return [o.kv_cache for o in outs]


def _allreduce_rank(rank: int, world: int, port: int, sizes: list[int], repeats: int, out) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    results = {}
    for n in sizes:
        x = torch.ones(n // 4)  # float32
        for _ in range(5):
            dist.all_reduce(x)
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(repeats):
            dist.all_reduce(x)
        results[n] = (time.perf_counter() - t0) / repeats
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


def allreduce_micro(world: int = 2, sizes=(8 << 10, 64 << 10, 4 << 20), repeats: int = 50) -> list[dict]:
    """gloo all-reduce over loopback between ``world`` processes: seconds per call by size."""
    import multiprocessing

    from ferrum_rpc.server.parallel.group import free_port

    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, world, port, list(sizes), repeats, out))
             for r in range(world)]
    for p in procs:
        p.start()
    results = out.get(timeout=600)
    for p in procs:
        p.join()
    records = [{"allreduce_world": world, "bytes": n, "us": 1e6 * s, "algbw_gbs": n / s / 1e9}
               for n, s in results.items()]
    for r in records:
        log.info("%s", r)
    return records


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--modes", nargs="+", default=["argmax", "choice"], choices=["argmax", "choice"])
    parser.add_argument("--allreduce-only", action="store_true", help="only the gloo all-reduce micro-benchmark")
    args = parser.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    micro = allreduce_micro(2) + allreduce_micro(3)
    if args.allreduce_only:
        write_results("tensor_parallel_allreduce", micro)
        return
    with tempfile.TemporaryDirectory(prefix="bench-tp-") as folder:
        make_model(folder)
        records = [run(folder, d, b, args.steps, m) for m in args.modes for d in args.degrees for b in args.batches]
    for r in records:
        r.update(cpu=platform.processor() or platform.machine(), cores=torch.get_num_threads())
    print(f"{'mode':>6} {'degree':>6} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'all-reduce ms/fwd':>18} "
          f"{'LM-head ms/fwd':>15} {'LM-head B/fwd':>14}")
    for r in records:
        print(f"{r['mode']:>6} {r['degree']:>6} {r['batch']:>5} {r['tokens_per_s']:>8.1f} {r['step_ms']:>8.1f} "
              f"{r.get('allreduce_ms_per_forward', 0):>18.2f} {r.get('lm_head_reduce_ms_per_forward', 0):>15.2f} "
              f"{r.get('lm_head_bytes_per_forward', 0):>14.0f}")
    write_results("tensor_parallel", records + micro)


if __name__ == "__main__":
    main()
