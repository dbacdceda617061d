"""Decode throughput of the default model: transformers generate vs our executor
in-process (the model worker and executor the server runs, without gRPC) vs our
executor through gRPC, side by side in one run.

Prompt 32 tokens, 64 new tokens, greedy; output tokens per second end to end
(prefill included, as a user sees it: a batch's prompts are sent together and
share forwards) and decode-only (the prefill part
subtracted: for transformers, the same generate call stopped after one
token), each figure the median of several runs.  The systems take turns: each
round runs every one of them once (and, with ``llama.cpp`` among the systems, one
llama.cpp run of the same shape first), so a drift of the host's speed falls on
all alike, and each of our decode rows also keeps the median of the rounds' own
ratios to llama.cpp (``per_round_vs``); with ``--probe-rounds`` the bandwidth probe
opens each round and each row keeps the median of its rounds' step / weight-read
ratios (``per_round_floor``).

Variants: ``float32``, ``bfloat16``, ``int8`` / ``int4`` (our weight-only
``--quantize``, float32 activations) and ``w8a8`` / ``w4a8`` (the same weights,
activations quantized to int8 per block and multiplied in integers); the
quantized variants' transformers reference is float32.  A variant may name the
KV pool's dtype after it (``w4a8+kv=float32``: ``--kv-dtype float32``, where w8a8
and w4a8 hold bfloat16 by default); such a variant has no transformers rows.
``llama.cpp`` runs the same GGUF file at every batch size (its batch API, one
``llama_decode`` a step over all sequences) from its own cached environment (``python -m bench.llama_cpp --setup`` builds it once); while
``llama.cpp`` is among ``--systems`` (the default) a missing or failing anchor stops
the benchmark with one line and a non-zero exit.  Each gRPC row also splits the
decode step into weight-read time (weight bytes a step reads / memory read bandwidth
probed right before that variant and batch) and the rest, and reports the server
process's resident memory after the run and at its peak (loading included).

Beside those decode rows, every system runs prompt rows (one prompt of each of
``--prompt-lens`` tokens) and long-context decode rows (``--context-batches``
sequences holding each of ``--contexts`` tokens, then ``--context-steps`` timed
steps): see :mod:`bench.long_rows`.  Every row shows its share of the machine's
limit: decode steps against reading their weights (and, at long contexts, their KV)
at the probed bandwidth, prompts against their FLOPs at the GEMM peak torch reaches
here in their dtype (probed at the start and before each set of prompt rows, the
best probe of the run kept; the quantized modes and llama.cpp's Q4_1 are held
against float32's).  ``--quick`` is a small run
(float32, batch 1, a 128-token prompt, 2,048 tokens of context; transformers and gRPC)
that shows every kind of row.

    python -m bench.decode_throughput [--batches 1 8 32] [--dtypes float32 bfloat16 int8 int4 w8a8 w4a8]
    python -m bench.decode_throughput --quick
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
from bench.common import (RSS_MB, compute_peak_gflops, dtype_and_quantize, kv_variant, log, read_bandwidth_gbs,
                          served, write_results)
from bench.long_rows import (distinct_prompts, hf_context_steps, hf_prompt_s, kv_bytes, model_config,
                             ours_context_steps, ours_prompt_s, prompt_flops)
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.kv.pool import KV_TORCH_DTYPES, KvPool
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


def executor_calls(worker: ModelWorker):
    """In process, through the worker entry points the servicer's handlers use:
    (prefill_all, batch_decode, release)."""
    def prefill_all(prompts):  # submitted together, as BatchPrefill does: their parts share forwards
        return [f.result() for f in [worker.submit_prefill(p, None, GREEDY) for p in prompts]]

    def release(cache_id):
        return worker.submit(worker.executor.release_cache, cache_id).result()

    return prefill_all, lambda items: worker.submit_decode(items, GREEDY).result(), release


def grpc_calls(client: ExecutorClient, pool: ThreadPoolExecutor):
    """Through gRPC: (prefill_all, batch_decode, release)."""
    def prefill_all(prompts):  # sent together; the server batches them
        return list(pool.map(lambda p: client.prefill(p, logits=GREEDY), prompts))

    return prefill_all, lambda items: client.batch_decode(items, GREEDY), client.release_cache


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


def run_llama_cpp(batch: int, prompt_len: int, new_tokens: int, repeats: int, warmup: bool = True) -> dict:
    """One ``bench.llama_cpp --run`` in the anchor's environment: its JSON record (exits
    with one line when the anchor is missing or the run fails)."""
    import json
    import os
    import subprocess
    from pathlib import Path

    cmd = [str(llama_cpp.require()), "-m", "bench.llama_cpp", "--run", "--gguf", str(find_gguf()),
           "--batch", str(batch), "--prompt-len", str(prompt_len), "--new-tokens", str(new_tokens),
           "--repeats", str(repeats), "--threads", str(torch.get_num_threads()), *(() if warmup else ("--no-warmup",))]
    root = str(Path(__file__).resolve().parent.parent)
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env={**os.environ, "PYTHONPATH": root})
    return json.loads(llama_cpp.anchor_output(done, f"--run at batch {batch}").strip().splitlines()[-1])


def run_transformers(model, batch_prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(batch_prompts, device=model.device)
    if new_tokens > 1:  # the prefill part: the same call stopping after its first token
        PREFILL_SECONDS.append(run_transformers(model, batch_prompts, 1))
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False)
    assert out.shape[1] == ids.shape[1] + new_tokens
    return time.perf_counter() - start


QUICK = dict(batches=[1], dtypes=["float32"], systems=["transformers", "grpc"], new_tokens=16, repeats=1,
             prompt_lens=[128], contexts=[2048], context_batches=[1], context_steps=4)


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int8", "int4", "w8a8", "w4a8"])
    parser.add_argument("--systems", nargs="+", default=["transformers", "executor", "grpc", "llama.cpp"],
                        help="also grpc-ahead: the server chooses greedy tokens and decodes ahead")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--probe-rounds", action="store_true",
                        help="probe the read bandwidth at the start of every round of the decode rows, and give "
                             "each row the median of its rounds' step / weight-read ratios (per_round_floor)")
    parser.add_argument("--prompt-lens", type=int, nargs="*", default=[128, 512, 2048],
                        help="prompt rows: one prompt of each length (none: no prompt rows)")
    parser.add_argument("--contexts", type=int, nargs="*", default=[2048, 8192],
                        help="long-context decode rows: tokens each sequence holds (none: no such rows)")
    parser.add_argument("--context-batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--context-steps", type=int, default=16, help="timed decode steps of a long-context row")
    parser.add_argument("--quick", action="store_true", help="a small run showing every kind of row: "
                        + ", ".join(f"{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    parser.add_argument("--out", default="decode_throughput")
    args = parser.parse_args(argv)
    if args.quick:  # the quick values replace the defaults; options given still win
        parser.set_defaults(**QUICK, out="decode_throughput_quick")
        args = parser.parse_args(argv)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if "llama.cpp" in args.systems:
        llama_cpp.require()  # before anything long: a missing anchor stops the run at once
    model_dir = str(prepare_default_model())
    cfg = model_config(model_dir)
    records = []
    bandwidth = 0.0
    peaks: dict[str, float] = {}
    context_tokens = max(args.context_batches) * max(args.contexts, default=0)
    kv_tokens = max(32768, context_tokens + 1024)

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

    def probe_peak(dtype: str, before: str) -> None:
        """The GEMM-peak probe, in three child processes, again right before each set of
        prompt rows: the peak is the best any probe of the run reached (on a shared host
        a probe that loses its cores reads a fraction of it; none reads more)."""
        probes = sorted(compute_peak_gflops(dtype) for _ in range(3))
        peaks[dtype] = max(peaks.get(dtype, 0.0), probes[-1])
        log.info("%s GEMM peak before %s: %.1f GFLOP/s (probes %s)", dtype, before, peaks[dtype],
                 " ".join(f"{p:.1f}" for p in probes))

    for dtype in ("float32", "bfloat16"):
        probe_peak(dtype, "the run")
    first_peaks = dict(peaks)

    def prompt_rows(system, variant, runs_of):
        """``runs_of(tokens)`` -> the seconds of each run, for every prompt length."""
        probe_peak(peak_dtype(variant), f"{system} {variant} prompts")
        for tokens in args.prompt_lens:
            record_prompt(system, variant, tokens, runs_of(tokens))

    def prompt_turns(variant, prompt_of: dict) -> None:
        """Prompt rows of every system in ``prompt_of`` (system -> seconds of one prompt),
        after a warm-up each, the systems taking turns on each of ``--repeats`` prompts
        (each unlike the others: none is served from a cached prefix), so a drift of the
        host's speed falls on all of them alike; each row also keeps the median of the
        rounds' own ratios to the first system (``per_round_vs``)."""
        probe_peak(peak_dtype(variant), f"{variant} prompts")
        for tokens in args.prompt_lens:
            runs = {system: [] for system in prompt_of}
            for system, prompt_s in prompt_of.items():  # warm-ups
                prompt_s(distinct_prompts(1, tokens, salt=-1)[0])
            for k in range(args.repeats):
                for system, prompt_s in prompt_of.items():
                    runs[system].append(prompt_s(distinct_prompts(1, tokens, salt=k)[0]))
            first = next(iter(runs))
            for system, seconds in runs.items():
                record_prompt(system, variant, tokens, seconds)
                if system != first:
                    ratios = [a / b for a, b in zip(runs[first], seconds)]
                    records[-1]["per_round_vs"] = {first: round(statistics.median(ratios), 3)}
                    log.info("%-12s %-8s prompt %5d: %.2fx %s, the median of %d rounds' ratios", system, variant,
                             tokens, statistics.median(ratios), first, len(ratios))

    def record(system, dtype, batch, seconds, runs, prefill_s, **extra):
        tps = batch * args.new_tokens / seconds
        decode_tps = batch * (args.new_tokens - 1) / (seconds - prefill_s)
        rec = {"kind": "decode", "system": system, "dtype": dtype, "batch": batch, "tokens_per_s": round(tps, 2),
               "decode_tokens_per_s": round(decode_tps, 2), "prefill_s": round(prefill_s, 4),
               "seconds": [round(r, 4) for r in runs], "new_tokens": args.new_tokens,
               "prompt_len": args.prompt_len, "bandwidth_gbs": round(bandwidth, 2)}
        if extra.get("weight_bytes"):
            step_ms = 1e3 * (seconds - prefill_s) / (args.new_tokens - 1)
            weight_ms = extra["weight_bytes"] / (bandwidth * 1e9) * 1e3
            extra.update(step_ms=round(step_ms, 2), weight_read_ms=round(weight_ms, 2),
                         rest_fraction=round(1 - weight_ms / step_ms, 3), **limit("weight reads", weight_ms, step_ms))
        rec.update(extra)
        records.append(rec)
        log.info("%-12s %-8s batch %3d: %8.1f tokens/s end to end, %8.1f decode-only %s",
                 system, dtype, batch, tps, decode_tps, extra or "")

    def record_prompt(system, variant, tokens, runs):
        seconds = statistics.median(runs)
        peak = peaks[peak_dtype(variant)]
        flops = prompt_flops(cfg, tokens)
        rec = {"kind": "prompt", "system": system, "dtype": variant, "batch": 1, "prompt_tokens": tokens,
               "tokens_per_s": round(tokens / seconds, 2), "ms": round(1e3 * seconds, 2),
               "seconds": [round(r, 4) for r in runs], "gflop": round(flops / 1e9, 2),
               "gflops": round(flops / seconds / 1e9, 1), "peak_gflops": round(peak, 1),
               **limit("compute peak", flops / (peak * 1e9) * 1e3, 1e3 * seconds)}
        records.append(rec)
        log.info("%-12s %-8s prompt %5d: %8.1f tokens/s, %7.1f GFLOP/s, %.0f%% of the %s peak", system, variant,
                 tokens, rec["tokens_per_s"], rec["gflops"], 100 * rec["limit_share"], peak_dtype(variant))

    def record_context(system, variant, batch, context, steps, weight_bytes, element_bytes):
        step_ms = 1e3 * statistics.median(steps)
        read = weight_bytes + batch * kv_bytes(cfg, context, element_bytes)
        rec = {"kind": "context", "system": system, "dtype": variant, "batch": batch, "context": context,
               "tokens_per_s": round(1e3 * batch / step_ms, 2), "step_ms": round(step_ms, 2),
               "steps_ms": [round(1e3 * t, 2) for t in steps], "weight_bytes": weight_bytes,
               "kv_bytes": read - weight_bytes, "bandwidth_gbs": round(bandwidth, 2),
               **limit("weight and KV reads", read / (bandwidth * 1e9) * 1e3, step_ms)}
        records.append(rec)
        log.info("%-12s %-8s batch %d at %5d tokens: %7.2f ms a step, %.0f%% of its read floor (KV %.0f%% of it)",
                 system, variant, batch, context, step_ms, 100 * rec["limit_share"], 100 * (1 - weight_bytes / read))

    def context_rows(system, variant, steps_of, weight_bytes, element_bytes):
        """``steps_of(batch_prompts, steps)`` -> step seconds, for every batch and context."""
        for context in args.contexts:
            for batch in args.context_batches:
                probe_bandwidth(f"{system} {variant} batch {batch} at {context} tokens")
                batch_prompts = distinct_prompts(batch, context - args.context_steps, salt=context + batch)
                record_context(system, variant, batch, context, steps_of(batch_prompts, args.context_steps),
                               weight_bytes, element_bytes)

    anchor = "llama.cpp" in args.systems

    def anchor_turn(batch: int) -> tuple[float, float]:
        """One llama.cpp run of the decode rows' shape beside ours: (seconds, prefill seconds)."""
        out = run_llama_cpp(batch, args.prompt_len, args.new_tokens, 1)
        return out["seconds"], out["prefill_s"]

    if anchor:
        gguf_bytes = find_gguf().stat().st_size  # every tensor is read once a step (the head is the embedding)
        for batch in args.batches:
            probe_bandwidth(f"llama.cpp batch {batch}")
            out = run_llama_cpp(batch, args.prompt_len, args.new_tokens, args.repeats)
            record("llama.cpp", "Q4_1", batch, out["seconds"], out["runs"], out["prefill_s"],
                   weight_bytes=gguf_bytes, rss_mb=round(out["rss_mb"], 1), peak_rss_mb=round(out["peak_rss_mb"], 1))
        prompt_rows("llama.cpp", "Q4_1", lambda tokens: run_llama_cpp(1, tokens, 1, args.repeats)["prefill_runs"])
        context_rows("llama.cpp", "Q4_1", lambda prompts, steps: run_llama_cpp(
            len(prompts), len(prompts[0]), steps + 1, 1, warmup=False)["steps_s"], gguf_bytes, 2)  # f16 KV

    for variant in args.dtypes:
        base, kv_dtype = kv_variant(variant)
        dtype, quantize = dtype_and_quantize(base)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        kv_torch = KV_TORCH_DTYPES[ExecutorConfig(dtype=dtype, quantize=quantize, kv_dtype=kv_dtype).kv_dtype_name]
        element_bytes = KvPool.bytes_per_token(1, 1, head_dim, kv_torch) / (2 * head_dim)  # an int8 pool's scales in
        runners, calls, weight_bytes, worker = {}, {}, {}, None
        remote = {"grpc", "grpc-ahead"} & set(args.systems)
        if "transformers" in args.systems and quantize == "none" and kv_dtype == "auto":
            from transformers import AutoModelForCausalLM

            hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=TORCH_DTYPES[dtype]).eval()
            runners["transformers"] = lambda p, m=hf: run_transformers(m, p, args.new_tokens)
            weight_bytes["transformers"] = weight_bytes_per_step(hf)
        if "executor" in args.systems or remote:  # the in-process one also counts weight bytes
            config = ExecutorConfig(dtype=dtype, kv_dtype=kv_dtype, kv_tokens=kv_tokens, quantize=quantize)
            worker = ModelWorker(functools.partial(TorchExecutor.from_path, "bench", model_dir, config), "bench",
                                 config.batch_wait_ms)  # loads on its own thread, as the server does
            ex = worker.loaded.result()
            ours_bytes, kv_mb = weight_bytes_per_step(ex.model), ex.pool.nbytes / 2**20
            weight_bytes.update({s: ours_bytes for s in ("executor", "grpc", "grpc-ahead")})
            if "executor" in args.systems:
                calls["executor"] = executor_calls(worker)
                runners["executor"] = lambda p, c=calls["executor"]: run_ours(*c, p, args.new_tokens)
        extra = ("--quantize", quantize, "--kv-dtype", kv_dtype)
        with served(model_dir, dtype, extra, kv_tokens) if remote else _null() as target:
            if target:
                client = ExecutorClient(target, timeout=600)
                pool = ThreadPoolExecutor(max(args.batches + args.context_batches))
                if "grpc" in args.systems:
                    calls["grpc"] = grpc_calls(client, pool)
                    runners["grpc"] = lambda p, c=calls["grpc"]: run_ours(*c, p, args.new_tokens)
                if "grpc-ahead" in args.systems:
                    runners["grpc-ahead"] = lambda p, c=client: run_grpc_ahead(c, pool, p, args.new_tokens)
            for batch in args.batches if runners else ():  # (only llama.cpp: its own rows above)
                batch_prompts = prompts(batch, args.prompt_len)
                probe_bandwidth(f"{variant} batch {batch}")
                for run in runners.values():
                    run(batch_prompts[:1])  # warm-up
                runs, prefills, beside, probes = decode_turns(
                    runners, batch_prompts, args.repeats, lambda: anchor_turn(batch) if anchor else None,
                    lambda: read_bandwidth_gbs() if args.probe_rounds else None)
                for system in runners:
                    split = {"weight_bytes": weight_bytes.get(system)}
                    if system in ("grpc", "executor"):
                        split["kv_pool_mb"] = round(kv_mb, 1)
                    if beside:
                        split["per_round_vs"] = per_round_vs(runs[system], prefills[system], beside)
                    if probes and split["weight_bytes"]:
                        split["per_round_floor"] = per_round_floor(runs[system], prefills[system], probes,
                                                                   split["weight_bytes"], args.new_tokens - 1)
                    record(system, variant, batch, statistics.median(runs[system]), runs[system],
                           statistics.median(prefills[system]), **split)
            prompt_of = {"transformers": lambda p: hf_prompt_s(hf, p)} if "transformers" in runners else {}
            steps_of = {"transformers": lambda b, n: hf_context_steps(hf, b, n)} if "transformers" in runners else {}
            for system, c in calls.items():
                prompt_of[system] = lambda p, c=c: ours_prompt_s(c, p)
                steps_of[system] = lambda b, n, c=c: ours_context_steps(c, b, n)
            prompt_turns(variant, prompt_of)
            for system, steps in steps_of.items():
                context_rows(system, variant, steps, weight_bytes[system], element_bytes)
        if target in RSS_MB:
            for rec in records:
                if rec["system"] == "grpc" and rec["dtype"] == variant and rec["kind"] == "decode":
                    rec["rss_mb"] = round(RSS_MB[target]["VmRSS"], 1)
                    rec["peak_rss_mb"] = round(RSS_MB[target]["VmHWM"], 1)
        runners.clear()
        if worker is not None:
            worker.stop()
    write_results(args.out, records, {"peak_gflops_at_start": {d: round(v, 1) for d, v in first_peaks.items()}})
    from bench.report import decode_rows, limits_table, step_table

    decode = decode_rows(records)
    print_table(decode)
    print_table(decode, "decode_tokens_per_s")

    print(step_table(decode))
    print(limits_table(records))


def decode_turns(runners: dict, batch_prompts: list[list[int]], repeats: int, anchor, probe=lambda: None):
    """``repeats`` rounds in which every runner (and ``anchor()``, unless it returns None)
    generates once, one after another, so a drift of the host's speed falls on all of
    them alike; ``probe()`` (the read bandwidth, or None) opens each round.  Returns
    each runner's seconds and prefill seconds, a list a round, the anchor's (seconds,
    prefill seconds) a round (empty without one) and the probes (empty without them)."""
    runs = {system: [] for system in runners}
    prefills = {system: [] for system in runners}
    beside, probes = [], []
    for _ in range(repeats):
        if (gbs := probe()) is not None:
            probes.append(gbs)
        turn = anchor()
        if turn is not None:
            beside.append(turn)
        for system, run in runners.items():
            before = len(PREFILL_SECONDS)
            runs[system].append(run(batch_prompts))
            prefills[system].append(PREFILL_SECONDS[-1] if len(PREFILL_SECONDS) > before else 0.0)
    return runs, prefills, beside, probes


def per_round_floor(runs: list[float], prefills: list[float], probes: list[float], weight_bytes: int,
                    steps: int) -> dict:
    """A row's decode step against reading its weights at the bandwidth probed at the start
    of the same round: the median of the rounds' step / weight-read ratios, and the probes."""
    ratios = [(r - p) / steps / (weight_bytes / (gbs * 1e9)) for r, p, gbs in zip(runs, prefills, probes)]
    return {"step_vs_weight_reads": round(statistics.median(ratios), 3),
            "bandwidth_gbs": [round(g, 1) for g in probes], "rounds": len(ratios)}


def per_round_vs(runs: list[float], prefills: list[float], beside: list[tuple[float, float]]) -> dict:
    """A row's speed against the anchor's run in the same round, the median over the
    rounds: end to end (the same tokens, so its seconds over ours) and decode-only."""
    whole = [b / r for r, (b, _) in zip(runs, beside)]
    decode = [(b - bp) / (r - rp) for r, rp, (b, bp) in zip(runs, prefills, beside)]
    return {"llama.cpp": round(statistics.median(whole), 3),
            "llama.cpp_decode": round(statistics.median(decode), 3), "rounds": len(whole)}


def peak_dtype(variant: str) -> str:
    """The GEMM peak a variant's prompts are held against (bfloat16's, else float32's)."""
    return "bfloat16" if variant == "bfloat16" else "float32"


def limit(name: str, floor_ms: float, measured_ms: float) -> dict:
    """A row's limit: what bounds it, the time that alone would take, and the share of
    the measured time it is (1.0: at the machine's limit)."""
    return {"limit": name, "limit_ms": round(floor_ms, 3), "limit_share": round(floor_ms / measured_ms, 3)}


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
