"""LoRA adapters on the real model, in process: decode steps of a batch of 32 spread
over 4 rank-16 adapters against the same batch on the base model, one sequence with
one adapter against the base, and the time to read a rank-16 adapter into the
registry.  The adapters are made here with peft (random low-rank weights on every
target module); the steps alternate base and adapter runs so both see the same
machine, and each figure is a median.

    python -m bench.lora [--steps 24] [--dtype float32] [--quantize none] [--threads N]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.common import write_results
from ferrum_rpc.paths import default_model_dir
from ferrum_rpc.server.kv.pool import KvPool
from ferrum_rpc.server.models import TORCH_DTYPES, load_model
from ferrum_rpc.server.models.lora import AdapterSet

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
PROMPT = 16


def make_adapters(model_dir: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of ``rank`` on every target module, random A and B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    folders = []
    for i in range(count):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        torch.manual_seed(i)
        peft = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                               init_lora_weights=False))
        with torch.no_grad():
            for name, p in peft.named_parameters():
                if "lora_B" in name:
                    p.mul_(0.01)
        peft.save_pretrained(out / f"a{i}")
        folders.append(out / f"a{i}")
    return folders


class Batch:
    """``len(slots)`` sequences with their own blocks, prefilled, then stepped a token each."""

    def __init__(self, model, pool: KvPool, first_block: int, slots: list[int] | None, steps: int):
        self.model, self.pool, self.n = model, pool, (1 if slots is None else len(slots))
        self.slots = None if slots is None or all(s < 0 for s in slots) else torch.tensor(slots)
        per = -(-(PROMPT + steps + 4) // pool.block_size)
        self.tables = [list(range(first_block + b * per, first_block + (b + 1) * per)) for b in range(self.n)]
        self.blocks_used = per * self.n
        ids = torch.tensor([[100 + 7 * b + t for t in range(PROMPT)] for b in range(self.n)])
        self._forward(ids, [0] * self.n, [PROMPT] * self.n)
        self.length = PROMPT

    def _forward(self, ids, starts, counts):
        kv = self.pool.batch(self.tables, starts, counts)
        with torch.no_grad():
            hidden = self.model(ids, kv.positions, kv, adapter_slots=self.slots)
            return self.model.logits(hidden[:, -1]).argmax(-1)

    def step(self) -> float:
        start = time.perf_counter()
        self._forward(torch.full((self.n, 1), 5), [self.length] * self.n, [1] * self.n)
        self.length += 1
        return time.perf_counter() - start


def compare(model, slots: list[int], steps: int) -> dict:
    """Median step of the batch on the base and with ``slots``, alternating."""
    cfg = model.config
    per = -(-(PROMPT + steps + 8) // 16)
    pool = KvPool(cfg.num_layers, 2 * len(slots) * per + 2, 16, cfg.num_kv_heads, cfg.head_dim,
                  model.model.embed_tokens.weight.dtype, torch.device("cpu"))
    base = Batch(model, pool, 0, [-1] * len(slots), steps + 2)
    lora = Batch(model, pool, base.blocks_used, slots, steps + 2)
    base.step(), lora.step()  # warm
    times = {"base": [], "lora": []}
    for _ in range(steps):
        times["base"].append(base.step())
        times["lora"].append(lora.step())
    base_ms, lora_ms = (statistics.median(times[k]) * 1e3 for k in ("base", "lora"))
    return {"batch": len(slots), "base_ms": base_ms, "lora_ms": lora_ms,
            "base_tok_s": len(slots) / base_ms * 1e3, "lora_tok_s": len(slots) / lora_ms * 1e3,
            "ratio": base_ms / lora_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = default_model_dir()
    model = load_model(model_dir, TORCH_DTYPES[args.dtype], torch.device("cpu"), quantize=args.quantize)
    registry = AdapterSet(model, max_adapters=8, max_rank=64)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        folders = make_adapters(model_dir, Path(tmp), 4, args.rank)
        loads = []
        for i in range(3):
            start = time.perf_counter()
            registry.add(f"load{i}", folders[0])
            loads.append(time.perf_counter() - start)
            registry.remove(f"load{i}")
        slots = [registry.add(f"a{i}", f) for i, f in enumerate(folders)]
        record = {"what": "load", "rank": args.rank, "load_s": statistics.median(loads),
                  "bytes": registry.get("a0").nbytes}
        print(f"load a rank-{args.rank} adapter: {record['load_s'] * 1e3:.0f} ms median of 3 "
              f"({record['bytes'] / 2**20:.1f} MiB)", flush=True)
        records.append(record)
    cases = [("b32 4 adapters, rows grouped by adapter", [slots[i // 8] for i in range(32)], 0.8),
             ("b32 4 adapters, rows interleaved", [slots[i % 4] for i in range(32)], 0.8),
             ("b1 one adapter", [slots[0]], 0.9)]
    for name, picks, target in cases:
        record = {"what": name, "dtype": args.dtype, "quantize": args.quantize, "rank": args.rank,
                  "threads": torch.get_num_threads(),
                  **compare(model, picks, args.steps), "target": target}
        print(f"{name}: base {record['base_ms']:.1f} ms/step ({record['base_tok_s']:.0f} tok/s), "
              f"adapters {record['lora_ms']:.1f} ms/step ({record['lora_tok_s']:.0f} tok/s): "
              f"{record['ratio']:.2f}x (target >= {target}x)", flush=True)
        records.append(record)
    print("written:", write_results("lora", records))


if __name__ == "__main__":
    main()
