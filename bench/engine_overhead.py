"""What the engine costs between two forwards, in process: a decode-ahead run through the
model worker, in bursts and in plain steps, against a bare loop of the same model calls
on the worker's thread.

For each variant (a dtype or a quantization of the default model) one model worker,
and in each round, taking turns:

- ``engine``: a 32-token prompt, then ``start_ahead`` greedy for ``--new-tokens``
  tokens, its entries taken in groups of ``UNWATCHED_FORWARDS_PER_RESPONSE`` as the
  RPC layer takes them for a client that watches no token; the run goes on in bursts
  (``server/engine/burst.py``);
- ``plain``: the same with the worker's bursts off: the scheduler, the plan, the KV
  bookkeeping, the token choice and the outputs around every forward;
- ``bare``: on the worker thread, a sequence holding the prompt but its last token, room
  reserved for the rest, and a loop of the model's forward at one position, its LM head
  and the greedy pass over the row (``greedy_stats``; with ``--choice sampled``, a seeded
  top-p draw, ``choose_tokens`` at the position), from the prompt's last position on.

All three choose the same tokens (the bare loop's first step recomputes the prompt's
last position as a decode step, which the batch-invariant kernels give the prompt's
bits), and the benchmark checks that they do.  Each row keeps the medians of the
rounds' own ratios to the bare loop (what the engine's Python between forwards costs,
in bursts and in plain steps) and of bursts to plain steps.

    .venv/bin/python -m bench.engine_overhead [--variants w4a8 bfloat16 float32] [--new-tokens 256] [--rounds 8]
        [--choice greedy|sampled]
"""

from __future__ import annotations

import argparse
import functools
import logging
import statistics
import threading
import time

import torch

from bench.common import dtype_and_quantize, log, write_results
from ferrum_rpc.client.ahead import UNWATCHED_FORWARDS_PER_RESPONSE
from ferrum_rpc.server.choice.rows import greedy_stats
from ferrum_rpc.server.choice.sampling import choose_tokens
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.server.kv.pool import KvBatch
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.types import DecodeInput, TokenChoice

CHOICES = {"greedy": TokenChoice(temperature=0.0),
           "sampled": TokenChoice(temperature=0.8, top_p=0.9, seed=5)}  # a seeded top-p draw at each position


def engine_run(worker: ModelWorker, prompt: list[int], new_tokens: int,
               choice: TokenChoice = CHOICES["greedy"]) -> tuple[float, list[int]]:
    """Seconds a token of a decode-ahead run after ``prompt``, and its ``new_tokens`` tokens
    (the prompt's choice first)."""
    first = worker.submit_prefill(prompt, None, None, choice=choice).result()
    tokens = [first.chosen.token_id]
    item = DecodeInput(tokens[0], first.kv_cache, choice)
    per = UNWATCHED_FORWARDS_PER_RESPONSE
    ready = threading.Event()
    start = time.perf_counter()
    run = worker.start_ahead([item], new_tokens - 1, frozenset(), "", None, per + 1)
    run.on_entry = lambda: ready.set() if run.queued >= per or not run.running else None
    while not run.done:
        ready.clear()
        if run.running and run.queued < per:
            ready.wait()
            continue
        tokens += [e.out.chosen.token_id for entry in run.take_some(per) for e in entry]
    elapsed = time.perf_counter() - start
    worker.submit(worker.executor.release_cache, run.last[0].kv_cache.cache_id).result()
    return elapsed / (new_tokens - 1), tokens


def bare_run(ex: TorchExecutor, prompt: list[int], new_tokens: int,
             choice: TokenChoice = CHOICES["greedy"]) -> tuple[float, list[int]]:
    """The same tokens from a loop of forward, LM head and token choice (worker thread):
    seconds a token, and the tokens.  The choice is the greedy pass alone for greedy,
    else ``choose_tokens`` at the position.  The sequence holds the prompt but its last
    token, with room reserved (private blocks, as a decode step's plan reserves them)
    for the positions the loop writes; nothing is committed, and the release drops it all."""
    out = ex.prefill(prompt[:-1], policy=None, choice=choice)
    seq, at = ex.checks.resolve(out.kv_cache, ""), len(prompt) - 1
    ex.pool.copy_blocks(ex.kv.prepare_write(seq, at, at + new_tokens).copies)
    table, bs = list(seq.block_ids), ex.kv.block_size
    tables = torch.tensor([table], dtype=torch.int64, device=ex.pool.k.device)
    model, token, tokens = ex.model, prompt[-1], []
    start = time.perf_counter()
    with torch.inference_mode():
        for p in range(at, at + new_tokens):
            kv = KvBatch.static(ex.pool, tables, torch.tensor([[p]]), torch.tensor([table[p // bs] * bs + p % bs]))
            hidden = model(torch.tensor([[token]]), kv.positions, kv)
            logits = model.logits(hidden.view(1, -1))
            token = int(greedy_stats(logits)[0][0] if choice.is_greedy else
                        choose_tokens(logits.float(), [choice], [p + 1]).token_ids[0])
            tokens.append(token)
    elapsed = time.perf_counter() - start
    ex.release_cache(seq.cache_id)
    return elapsed / new_tokens, tokens


def turns(worker: ModelWorker, prompt: list[int], new_tokens: int,
          choice: TokenChoice = CHOICES["greedy"]) -> tuple[float, float, float]:
    """One round: the engine's seconds a token in bursts and in plain steps, and the bare
    loop's; raises if their tokens differ."""
    engine_s, engine_tokens = engine_run(worker, prompt, new_tokens, choice)
    worker.bursts = False
    try:
        plain_s, plain_tokens = engine_run(worker, prompt, new_tokens, choice)
    finally:
        worker.bursts = True
    bare_s, bare_tokens = worker.submit(bare_run, worker.executor, prompt, new_tokens, choice).result()
    if not engine_tokens == plain_tokens == bare_tokens:
        raise AssertionError(f"the engine chose {engine_tokens[:8]}... in bursts, {plain_tokens[:8]}... in plain "
                             f"steps, the bare loop {bare_tokens[:8]}...")
    return engine_s, plain_s, bare_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", nargs="+", default=["w4a8", "bfloat16", "float32"])
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--choice", choices=sorted(CHOICES), default="greedy")
    parser.add_argument("--out", default="engine_overhead")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    model_dir = str(prepare_default_model())
    records = []
    for variant in args.variants:
        dtype, quantize = dtype_and_quantize(variant)
        config = ExecutorConfig(dtype=dtype, quantize=quantize, kv_tokens=4096)
        worker = ModelWorker(functools.partial(TorchExecutor.from_path, variant, model_dir, config), variant,
                             config.batch_wait_ms)
        worker.loaded.result()
        try:
            choice = CHOICES[args.choice]
            turns(worker, [(7 * i + 3) % 4000 + 100 for i in range(32)], 32, choice)  # warm-up
            engine, plain, bare = [], [], []
            for r in range(args.rounds):
                e, p, b = turns(worker, [(17 * i + 5 + 31 * r) % 4000 + 100 for i in range(32)], args.new_tokens,
                                choice)
                engine.append(e * 1e3)
                plain.append(p * 1e3)
                bare.append(b * 1e3)
                log.info("%s round %d/%d: engine %.3f ms in bursts, %.3f in plain steps, bare %.3f ms a token",
                         variant, r + 1, args.rounds, engine[-1], plain[-1], bare[-1])
        finally:
            worker.stop()
        records.append({"variant": variant, "choice": args.choice, "batch": 1, "new_tokens": args.new_tokens,
                        "rounds": args.rounds,
                        "engine_ms": [round(x, 3) for x in engine], "plain_ms": [round(x, 3) for x in plain],
                        "bare_ms": [round(x, 3) for x in bare],
                        "engine_vs_bare": round(statistics.median(e / b for e, b in zip(engine, bare)), 3),
                        "plain_vs_bare": round(statistics.median(p / b for p, b in zip(plain, bare)), 3),
                        "engine_vs_plain": round(statistics.median(e / p for e, p in zip(engine, plain)), 3)})
    print(f"{'variant':10} {'engine ms':>10} {'plain ms':>9} {'bare ms':>8} {'engine/bare':>12} {'plain/bare':>11} "
          f"{'engine/plain':>13}")
    for rec in records:
        print(f"{rec['variant']:10} {statistics.median(rec['engine_ms']):10.3f} {statistics.median(rec['plain_ms']):9.3f} "
              f"{statistics.median(rec['bare_ms']):8.3f} {rec['engine_vs_bare']:12.3f} {rec['plain_vs_bare']:11.3f} "
              f"{rec['engine_vs_plain']:13.3f}")
    write_results(args.out, records)


if __name__ == "__main__":
    main()
