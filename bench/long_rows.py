"""The prompt rows and long-context decode rows of ``bench.decode_throughput``, and the
machine limits every row is held against.

Prompt rows: one prompt of 128, 512 or 2,048 tokens run through the model (no decode),
prompt tokens per second; the limit is compute: the prompt's FLOPs (every projection
on every position, the LM head on the last one, causal attention) at the GEMM peak
torch reaches here for that dtype (:func:`bench.common.compute_peak_gflops`).

Long-context decode rows: batch 1 or 8 sequences holding 2,048 or 8,192 tokens of
context each (a prompt of that length less the steps, not timed), then greedy decode
steps, each timed; the row is the median step.  The limit is memory: the weights and
every sequence's KV read once a step, at the probed read bandwidth.  At 8,192 tokens
the KV of batch 8 is several times the weights: attention, not weights, dominates.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

TOKEN_IDS = 4000  # prompts' token ids stay below this (as bench.decode_throughput.prompts)


def model_config(model_dir: str) -> dict:
    return json.loads((Path(model_dir) / "config.json").read_text())


def prompt_flops(cfg: dict, tokens: int) -> float:
    """FLOPs of one prompt of ``tokens`` tokens: every projection on every position, the
    LM head on the last one, and causal attention (QK^T and PV over the lower triangle)."""
    h, i, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_token = layers * (h * q + 2 * h * kv + q * h + 3 * h * i)
    attention = layers * 2 * tokens * tokens * q  # 2 matmuls x 2 FLOPs x tokens^2 / 2 (causal) x q
    return 2.0 * per_token * tokens + 2.0 * cfg["vocab_size"] * h + attention


def kv_bytes(cfg: dict, tokens: int, element_bytes: int) -> int:
    """Bytes of K and V that ``tokens`` tokens of context hold (what a step reads of them)."""
    hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return round(tokens * cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * hd * element_bytes)


def distinct_prompts(batch: int, length: int, salt: int) -> list[list[int]]:
    """``batch`` prompts unlike each other and unlike those of another ``salt`` from their
    first token on (so no run is served from an earlier run's cached prefix)."""
    return [[1 + (7 * b + 13 * i + 131 * salt + 17) % TOKEN_IDS for i in range(length)] for b in range(batch)]


# -- transformers ------------------------------------------------------------------------
def hf_prompt_s(model, prompt: list[int]) -> float:
    """Seconds of one forward over ``prompt`` (logits of the last position only, as ours)."""
    ids = torch.tensor([prompt])
    start = time.perf_counter()
    with torch.no_grad():
        model(ids, use_cache=False, logits_to_keep=1)
    return time.perf_counter() - start


def hf_context_steps(model, batch_prompts: list[list[int]], steps: int) -> list[float]:
    """The prompts into a KV cache (not timed), then ``steps`` greedy steps: seconds each."""
    with torch.no_grad():
        out = model(torch.tensor(batch_prompts), use_cache=True, logits_to_keep=1)
        past, times = out.past_key_values, []
        tokens = out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(steps):
            start = time.perf_counter()
            out = model(tokens, past_key_values=past, use_cache=True)
            past, tokens = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            times.append(time.perf_counter() - start)
    return times


# -- ours (in process or through gRPC: the calls of bench.decode_throughput.ours_calls) ---
def ours_prompt_s(calls, prompt: list[int]) -> float:
    prefill_all, _, release = calls
    start = time.perf_counter()
    (out,) = prefill_all([prompt])
    elapsed = time.perf_counter() - start
    release(out.kv_cache.cache_id)
    return elapsed


def ours_context_steps(calls, batch_prompts: list[list[int]], steps: int) -> list[float]:
    from ferrum_rpc.types import DecodeInput

    prefill_all, batch_decode, release = calls
    outs = prefill_all(batch_prompts)
    handles, tokens, times = [o.kv_cache for o in outs], [o.logits.argmax()[0] for o in outs], []
    for _ in range(steps):
        start = time.perf_counter()
        outs = batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)])
        times.append(time.perf_counter() - start)
        handles, tokens = [o.kv_cache for o in outs], [o.logits.argmax()[0] for o in outs]
    for h in handles:
        release(h.cache_id)
    return times
