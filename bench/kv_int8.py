"""The int8 KV pool (--kv-dtype int8) on the real default model, in process (the
executor the server runs):

- capacity: sequences of 4,000 tokens that fit in the bytes of a float32 pool of
  ``--pool-tokens`` tokens, float32 against int8 (and bfloat16), from the pools' own
  byte counts (int8: values and their float16 scales, one a block of 32);
- accuracy: 32 prompts of 64 tokens (windows of tests/data/english.txt), 64 greedy
  tokens each on a float32 cache; then every continuation teacher-forced on an int8
  (and a bfloat16) cache: the share of positions whose argmax equals float32's
  (greedy agreement), the max and mean absolute logit error against the float32
  cache's logits at the same positions, and free-running greedy: how many of the 32
  continuations come out token for token the same;
- speed: decode tokens/s at batch 1 and 8 after a 512-token prompt, int8 against
  bfloat16 (and float32) caches.  The machine may be shared: the figures are as
  measured, under whatever else ran.

    python -m bench.kv_int8 [--steps 32] [--out kv_int8]
    python -m bench.kv_int8 --turns 6 --out kv_int8_turns   # speed only, the caches taking turns
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import log, write_results
from ferrum_rpc.client.generate import load_tokenizer
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.kv.pool import KV_TORCH_DTYPES, SCALES_LAYOUT, KvPool
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.types import DecodeInput, LogitsPolicy

ROOT = Path(__file__).resolve().parent.parent
PROMPTS, PROMPT_TOKENS, NEW_TOKENS, SEQ_TOKENS = 32, 64, 64, 4000


def capacity(mc, pool_tokens: int, block: int) -> dict:
    per = {name: KvPool.bytes_per_token(mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype)
           for name, dtype in KV_TORCH_DTYPES.items()}
    budget = per["float32"] * pool_tokens
    blocks_a_seq = -(-SEQ_TOKENS // block)
    fits = {name: budget // (b * block) // blocks_a_seq for name, b in per.items()}
    return {"pool_bytes": budget, "bytes_per_token": per, "sequences_of_4000": fits,
            "int8_over_float32": fits["int8"] / fits["float32"]}


def executor(model_dir: Path, kv_dtype: str, tokens: int = 8192) -> TorchExecutor:
    return TorchExecutor.from_path(kv_dtype, model_dir, ExecutorConfig(kv_dtype=kv_dtype, kv_tokens=tokens))


def greedy(ex: TorchExecutor, prompts: list[list[int]], n: int) -> np.ndarray:
    """(prompts, n) greedy tokens, all prompts decoding in one batch."""
    outs = [ex.prefill(p, None, LogitsPolicy.argmax()) for p in prompts]
    handles = [o.kv_cache for o in outs]
    tokens = [int(np.asarray(o.logits.argmax())[0]) for o in outs]
    got = [tokens]
    for _ in range(n - 1):
        outs = ex.batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)], LogitsPolicy.argmax())
        handles = [o.kv_cache for o in outs]
        tokens = [int(np.asarray(o.logits.argmax())[0]) for o in outs]
        got.append(tokens)
    for h in handles:
        ex.release_cache(h.cache_id)
    return np.asarray(got).T


def forced_logits(ex: TorchExecutor, prompts: list[list[int]], cont: np.ndarray) -> torch.Tensor:
    """(prompts, NEW_TOKENS, vocab) float32 logits predicting each continuation token, the
    continuation teacher-forced."""
    rows = []
    for p, c in zip(prompts, cont):
        out = ex.prefill(p + [int(t) for t in c[:-1]], None, LogitsPolicy.full(all_positions=True))
        ex.release_cache(out.kv_cache.cache_id)
        rows.append(torch.from_numpy(np.asarray(out.logits.values))[len(p) - 1:].float())
    return torch.stack(rows)


def decode_rate(ex: TorchExecutor, batch: int, steps: int, context: int, ids: list[int]) -> float:
    outs = [ex.prefill(ids[i * 7:i * 7 + context], None, LogitsPolicy.argmax()) for i in range(batch)]
    handles = [o.kv_cache for o in outs]
    for warm in (True, False):
        start = time.perf_counter()
        for _ in range(2 if warm else steps):
            outs = ex.batch_decode([DecodeInput(5, h) for h in handles], LogitsPolicy.argmax())
            handles = [o.kv_cache for o in outs]
    rate = batch * steps / (time.perf_counter() - start)
    for h in handles:
        ex.release_cache(h.cache_id)
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per rate")
    ap.add_argument("--pool-tokens", type=int, default=16384, help="the float32 pool whose bytes all share")
    ap.add_argument("--out", default="kv_int8")
    ap.add_argument("--turns", type=int, default=0,
                    help="speed only: this many rounds, each cache's rates in turn within a round (a loaded "
                         "host's drift then falls on every cache alike); the median round")
    args = ap.parse_args()
    model_dir = prepare_default_model()
    ids = load_tokenizer(model_dir)((ROOT / "tests" / "data" / "english.txt").read_text())["input_ids"]
    if args.turns:
        turns(model_dir, ids, args)
        return
    stride = (len(ids) - PROMPT_TOKENS) // PROMPTS
    prompts = [ids[i * stride:i * stride + PROMPT_TOKENS] for i in range(PROMPTS)]
    records: list[dict] = []

    f32 = executor(model_dir, "float32")
    cap = capacity(f32.model_config, args.pool_tokens, f32.kv.block_size)
    records.append({"kind": "capacity", **cap})
    log.info("capacity: %s", cap["sequences_of_4000"])
    reference = greedy(f32, prompts, NEW_TOKENS)
    ref_logits = forced_logits(f32, prompts, reference)
    assert (ref_logits.argmax(-1).numpy() == reference).all(), "float32 teacher-forced argmax is its greedy"
    rates = {"float32": {b: decode_rate(f32, b, args.steps, 512, ids) for b in (1, 8)}}
    del f32
    for kv in ("int8", "bfloat16"):
        ex = executor(model_dir, kv)
        logits = forced_logits(ex, prompts, reference)
        err = (logits - ref_logits).abs()
        free = greedy(ex, prompts, NEW_TOKENS)
        same = (free == reference).all(axis=1)
        first_diff = [int(np.argmax(f != r)) if not s else NEW_TOKENS for f, r, s in zip(free, reference, same)]
        rec = {"kind": "accuracy", "kv_dtype": kv, "prompts": PROMPTS, "prompt_tokens": PROMPT_TOKENS,
               "new_tokens": NEW_TOKENS,
               "greedy_agreement": float((logits.argmax(-1).numpy() == reference).mean()),
               "logit_abs_error_max": err.max().item(), "logit_abs_error_mean": err.mean().item(),
               "free_running_identical": int(same.sum()), "free_running_mean_tokens_before_divergence":
                   float(np.mean(first_diff))}
        records.append(rec)
        log.info("%s", rec)
        rates[kv] = {b: decode_rate(ex, b, args.steps, 512, ids) for b in (1, 8)}
        records.append({"kind": "capacity_check", "kv_dtype": kv, "pool_bytes_per_token": ex.pool.nbytes //
                        ((ex.kv.num_blocks + 1) * ex.kv.block_size)})
        del ex
    for kv, by_batch in rates.items():
        for b, r in by_batch.items():
            records.append({"kind": "decode", "kv_dtype": kv, "batch": b, "context": 512, "tokens_per_s": r})
            log.info("decode %s batch %d: %.1f tok/s", kv, b, r)
    write_results(args.out, records, {"note": "shared 2-core machine: figures taken under whatever else ran",
                                      "int8_layout": SCALES_LAYOUT,
                                      "decode_path": "every pool on the decode stack (int8 with set_kv_scales)"})


def turns(model_dir: Path, ids: list[int], args) -> None:
    caches = {kv: executor(model_dir, kv) for kv in ("int8", "bfloat16", "float32")}
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.turns):
        for b in (1, 8):
            for kv, ex in caches.items():
                rates.setdefault((kv, b), []).append(decode_rate(ex, b, args.steps, 512, ids))
    records = [{"kind": "decode", "kv_dtype": kv, "batch": b, "context": 512, "rounds": r,
                "tokens_per_s_median": float(np.median(r))} for (kv, b), r in rates.items()]
    for r in records:
        log.info("decode %s batch %d: median %.1f tok/s over %d rounds", r["kv_dtype"], r["batch"],
                 r["tokens_per_s_median"], len(r["rounds"]))
    write_results(args.out, records, {"note": "shared 2-core machine: the caches take turns within each round"})


if __name__ == "__main__":
    main()
