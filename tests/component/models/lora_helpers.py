"""Helpers of the LoRA tests: adapters made with peft on a checkpoint folder, the
oracle (transformers + peft), and our model driven with a KV pool as the engine
drives it (a batched prefill, then batched decode steps of given tokens)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from ferrum_rpc.server.kv.pool import KvPool

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(model_dir, out: Path, seed: int, r: int = 8, alpha: int = 16, targets=ALL, **extra) -> Path:
    """A PEFT LoRA adapter on the model in ``model_dir`` with random A and B (B
    scaled so the adapter moves the logits clearly without swamping the base)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    peft = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                           init_lora_weights=False, **extra))
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5 / max(p.shape[1], 1) ** 0.5)
    peft.save_pretrained(out)
    return Path(out)


def edit_config(folder: Path, out: Path, **changes) -> Path:
    """A copy of the adapter in ``folder`` with its config's fields changed."""
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (out / "adapter_config.json").write_text(json.dumps(config))
    (out / "adapter_model.safetensors").write_bytes((folder / "adapter_model.safetensors").read_bytes())
    return out


@functools.lru_cache(maxsize=16)
def oracle(model_dir, adapter: Path | None, model=None):
    """transformers' model (or ``model``) with peft's adapter on it: full-sequence logits
    (one per checkpoint and adapter, kept: they are read-only)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = model if model is not None else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf = hf.eval() if adapter is None else PeftModel.from_pretrained(hf, adapter).eval()

    @torch.no_grad()
    def logits(ids: list[int]) -> torch.Tensor:
        return hf(torch.tensor([ids])).logits[0].float()  # (T, V)

    return logits


@torch.no_grad()
def run(model, prompts: list[list[int]], slots: list[int], feeds: list[list[int]] | None = None,
        per_token: bool = False) -> list[torch.Tensor]:
    """Our model over ``prompts`` in one batched prefill, then one batched decode step
    per column of ``feeds`` (each sequence's next tokens): per sequence, its logits
    (1 + steps, V) at its last prompt token and at each fed token.  ``slots``: each
    sequence's adapter slot (-1 the base), passed per sequence or, ``per_token``, per token."""
    cfg, block = model.config, 4
    per_seq = 64 // block
    pool = KvPool(cfg.num_layers, per_seq * len(prompts), block, cfg.num_kv_heads, cfg.head_dim,
                  model.model.embed_tokens.weight.dtype, torch.device("cpu"))
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(len(prompts))]
    lengths = [len(p) for p in prompts]
    width = max(lengths)
    ids = torch.tensor([p + [p[-1]] * (width - len(p)) for p in prompts])
    out = [[] for _ in prompts]

    def step(ids: torch.Tensor, starts: list[int], counts: list[int]) -> torch.Tensor:
        kv = pool.batch(tables, starts, counts)
        seq_slots = torch.tensor(slots)
        arg = seq_slots.unsqueeze(1).expand(ids.shape).contiguous() if per_token else seq_slots
        return model(ids, kv.positions, kv, adapter_slots=arg)

    hidden = step(ids, [0] * len(prompts), lengths)
    for b, n in enumerate(lengths):
        out[b].append(model.logits(hidden[b, n - 1:n])[0])
    for k in range(len(feeds[0]) if feeds else 0):
        hidden = step(torch.tensor([[f[k]] for f in feeds]), [n + k for n in lengths], [1] * len(prompts))
        for b in range(len(prompts)):
            out[b].append(model.logits(hidden[b, :1])[0])
    return [torch.stack(rows) for rows in out]
