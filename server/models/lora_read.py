"""Reading a PEFT LoRA adapter folder (``adapter_config.json`` +
``adapter_model.safetensors``) with json and safetensors only, checked against the
hosted model: what the forward in ``lora.py`` cannot apply exactly is refused with
an ``AdapterError`` naming the config field or tensor at fault.

A LoRA adapter adds ``(x @ A^T) @ B^T * scale`` to a projection's output, A (r, in)
and B (out, r); ``scale`` is ``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
``use_rslora``), per module where ``rank_pattern`` / ``alpha_pattern`` say so.  The
scale is folded into B here, once.

What could only give non-finite logits is refused too: a NaN or an infinity in a
tensor, a value that overflows the serving dtype when converted (or, in B, once
scaled), and a scale that is not finite or whose magnitude passes ``MAX_SCALING``.

Under a root (``--adapter-root``) the folder and each file read are resolved
(symbolic links followed) and must lie inside it.  Errors name the field, file or
tensor and what was expected, never a value read from a file: a path may name any
file the server can read.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ferrum_rpc.hashing import files_digest
from .config import ModelConfig

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION + MLP
MAX_CONFIG_BYTES = 1 << 20
# The largest |scale| a module may have.  Real adapters use lora_alpha / r of about 0.25
# to 16; a bound far above that and far below the dtypes' range (3.4e38) keeps the
# scaled B, and its product with activations of ordinary size, finite.
MAX_SCALING = 1024.0
MAX_KEY_SHOWN = 160  # a tensor name the reader does not know is cut to this in errors
# config fields naming PEFT features the forward does not implement: refused when set
UNSUPPORTED = ("use_dora", "modules_to_save", "fan_in_fan_out", "lora_bias", "use_qalora", "use_bdlora",
               "layer_replication", "target_parameters", "trainable_token_indices", "alora_invocation_tokens",
               "megatron_config")
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served; ``field`` names the config field, file or
    tensor at fault."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class LoraWeights:
    """One adapter as read: per (layer, module) its A (r, in) and its B (out, r)
    with the scale folded in, in the serving dtype."""

    rank: int  # the largest rank of any module
    modules: tuple[str, ...]  # the target modules present, in MODULES order
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of the config and weight files (hashing.files_digest): its identity for caches and exports
    scaling: float  # lora_alpha / r (or / sqrt(r) with use_rslora) as the config states it, before any pattern


def module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target module's (out, in) in the model ``cfg`` describes."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}


def _pattern_value(patterns: dict, key: str, default):
    """PEFT's rule for ``rank_pattern`` / ``alpha_pattern``: the first pattern that
    matches the end of the module's name (after a dot), else the default."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", key):
            return value
    return default


def _positive_int(config: dict, field: str) -> int:
    value = config.get(field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(field, "must be a positive integer")
    return value


def inside(path: Path, root: Path | None, field: str) -> Path:
    """``path`` resolved, symbolic links followed (it must exist); with ``root`` (resolved
    already) it must lie inside it, so no link or /proc path leads out."""
    try:
        real = path.resolve(strict=True)
    except (OSError, RuntimeError) as exc:  # missing, unreadable, a loop of links
        why = "a loop of symbolic links" if isinstance(exc, RuntimeError) else exc.strerror or type(exc).__name__
        raise AdapterError(field, f"is not a folder or file the server can resolve ({why})") from None
    if root is not None and not real.is_relative_to(root):
        raise AdapterError(field, "lies outside --adapter-root (after following symbolic links)")
    return real


def read_config(folder: Path, cfg: ModelConfig, max_rank: int, root: Path | None = None) -> tuple[dict, Path]:
    """The adapter's config, checked field by field (before any tensor is read), and the
    resolved path it was read from."""
    if not (folder / CONFIG_FILE).is_file():
        raise AdapterError(CONFIG_FILE, "not found in the adapter folder")
    path = inside(folder / CONFIG_FILE, root, CONFIG_FILE)
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterError(CONFIG_FILE, f"larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(path.read_bytes())
    except json.JSONDecodeError as e:
        raise AdapterError(CONFIG_FILE, f"not valid JSON (line {e.lineno}, column {e.colno})") from None
    except (ValueError, UnicodeDecodeError):
        raise AdapterError(CONFIG_FILE, "not valid JSON (not UTF-8 text)") from None
    if not isinstance(config, dict):
        raise AdapterError(CONFIG_FILE, "not a JSON object")
    if config.get("peft_type") != "LORA":
        raise AdapterError("peft_type", "only LORA adapters are served (peft_type must be \"LORA\")")
    for field in UNSUPPORTED:
        if config.get(field):
            raise AdapterError(field, "is set: not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError("bias", "only 'none' is supported")
    rank = _positive_int(config, "r")
    if rank > max_rank:
        raise AdapterError("r", f"the rank is over the limit of {max_rank}")
    if not _finite_number(config.get("lora_alpha")):
        raise AdapterError("lora_alpha", "must be a number (finite)")
    for field in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(field) or {}
        if not isinstance(patterns, dict) or not all(_finite_number(v) for v in patterns.values()):
            raise AdapterError(field, "must map module patterns to numbers (finite)")
        config[field] = patterns
    if any(v > max_rank or v <= 0 for v in config["rank_pattern"].values()):
        raise AdapterError("rank_pattern", f"ranks must be in 1..{max_rank}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        if set(targets) - set(MODULES):
            raise AdapterError("target_modules", f"names a module that is not supported (only {', '.join(MODULES)})")
        if not targets:
            raise AdapterError("target_modules", "empty")
    elif targets is not None and not isinstance(targets, str):  # a string is a regex (or "all-linear")
        raise AdapterError("target_modules", "must be a list or a pattern")
    layers = config.get("layers_to_transform")
    if layers is not None:
        layers = [layers] if isinstance(layers, int) else layers
        if (not isinstance(layers, list) or not layers
                or not all(isinstance(i, int) and 0 <= i < cfg.num_layers for i in layers)):
            raise AdapterError("layers_to_transform", f"must name layers of this model, 0..{cfg.num_layers - 1}")
        config["layers_to_transform"] = sorted(set(layers))
    scale = _scale(config["lora_alpha"], rank, config)
    if not abs(scale) <= MAX_SCALING:
        raise AdapterError("lora_alpha", f"the scaling lora_alpha / r must be within +-{MAX_SCALING:g}")
    return config, path


def _finite_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _scale(alpha: float, rank: int, config: dict) -> float:
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _finite(tensor: torch.Tensor) -> bool:
    return bool(torch.isfinite(tensor).all())


def read_adapter(folder: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype,
                 root: str | Path | None = None) -> LoraWeights:
    """The adapter in ``folder``, checked against the model ``cfg`` describes, its
    weights in ``dtype`` (the activations'; quantized models take float32).  With
    ``root`` (a resolved folder) the folder and its files must lie inside it."""
    root = Path(root) if root else None
    folder = inside(Path(folder), root, "path")
    if not folder.is_dir():
        raise AdapterError("path", "is not a folder")
    config, _ = read_config(folder, cfg, max_rank, root)
    if not (folder / WEIGHTS_FILE).is_file():
        raise AdapterError(WEIGHTS_FILE, "not found in the adapter folder (only safetensors weights are read)")
    path = inside(folder / WEIGHTS_FILE, root, WEIGHTS_FILE)
    shapes = module_shapes(cfg)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(path, framework="pt") as f:
            for key in f.keys():
                layer, module, which = _place(key, cfg)
                found.setdefault((layer, module), {})[which] = f.get_tensor(key)
    except AdapterError:
        raise
    except Exception as e:  # safetensors raises its own error types for a malformed file
        raise AdapterError(WEIGHTS_FILE, f"unreadable as safetensors ({type(e).__name__})") from None
    if not found:
        raise AdapterError(WEIGHTS_FILE, "holds no LoRA tensors")
    modules = tuple(m for m in MODULES if any(m == mod for _, mod in found))
    targets = config.get("target_modules")
    if isinstance(targets, list) or targets == "all-linear":
        wanted = MODULES if targets == "all-linear" else targets
        if extra := sorted(set(modules) - set(wanted)):
            raise AdapterError("target_modules", f"tensors for {extra}, which target_modules does not name")
        layers = config["layers_to_transform"] or range(cfg.num_layers)
        if missing := [f"layers.{i}.{m}" for i in layers for m in wanted if (i, m) not in found]:
            raise AdapterError(WEIGHTS_FILE, f"missing tensors for {', '.join(missing[:4])}"
                                             f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''}")
    if config["layers_to_transform"] and (stray := sorted({i for i, _ in found} - set(config["layers_to_transform"]))):
        raise AdapterError("layers_to_transform", f"tensors for layers {stray}, which it does not name")
    weights, top = {}, 0
    for (layer, module), pair in sorted(found.items()):
        name = f"model.layers.{layer}.{'self_attn' if module in ATTENTION else 'mlp'}.{module}"
        if set(pair) != {"A", "B"}:
            raise AdapterError(WEIGHTS_FILE, f"missing tensor {name}.lora_{'B' if 'A' in pair else 'A'}.weight")
        a, b = pair["A"], pair["B"]
        rank = _pattern_value(config["rank_pattern"], name, config["r"])
        out, inp = shapes[module]
        for tensor, want, which in ((a, (rank, inp), "A"), (b, (out, rank), "B")):
            key = f"base_model.model.{name}.lora_{which}.weight"
            if tuple(tensor.shape) != want:
                raise AdapterError(key, f"shape {tuple(tensor.shape)}, this model needs {want} (rank {rank}): "
                                        f"an adapter for another model?")
            if not tensor.is_floating_point():
                raise AdapterError(key, f"dtype {tensor.dtype} is not a float type")
            if not _finite(tensor):
                raise AdapterError(key, "holds a NaN or an infinity")
        alpha = _pattern_value(config["alpha_pattern"], name, config["lora_alpha"])
        scale = _scale(alpha, rank, config)
        if not abs(scale) <= MAX_SCALING:
            raise AdapterError("alpha_pattern" if alpha != config["lora_alpha"] else "rank_pattern",
                               f"{name}'s scaling alpha / r must be within +-{MAX_SCALING:g}")
        a, b = a.to(dtype).contiguous(), (b.float() * scale).to(dtype).contiguous()
        for tensor, which in ((a, "A"), (b, "B")):
            if not _finite(tensor):
                raise AdapterError(f"base_model.model.{name}.lora_{which}.weight",
                                   f"overflows {str(dtype).removeprefix('torch.')} (the serving dtype)"
                                   + (" once scaled" if which == "B" else ""))
        weights[(layer, module)] = (a, b)
        top = max(top, rank)
    # the digest hashes the files' own names (a link's target may be named otherwise)
    return LoraWeights(top, modules, weights, files_digest([folder / CONFIG_FILE, folder / WEIGHTS_FILE]),
                       _scale(config["lora_alpha"], config["r"], config))


def _place(key: str, cfg: ModelConfig) -> tuple[int, str, str]:
    """(layer, module, "A" or "B") of a tensor's PEFT name, refusing what this model has no place for."""
    match = _KEY.fullmatch(key)
    if match is None:
        shown = key if len(key) <= MAX_KEY_SHOWN else f"{key[:MAX_KEY_SHOWN]}..."
        raise AdapterError(shown, "not a LoRA A/B tensor of a decoder projection (embeddings, lm_head, "
                                  "biases and other modules are not supported)")
    layer, parent, module = int(match[1]), match[2], match[3]
    if module not in MODULES or (parent == "self_attn") != (module in ATTENTION):
        raise AdapterError("target_modules", f"a tensor of a module that is not supported (only "
                                             f"{', '.join(MODULES)})")
    if layer >= cfg.num_layers:
        raise AdapterError("layers", f"{key} is for layer {layer}; this model has {cfg.num_layers} layers "
                                     f"(an adapter for another model?)")
    if module in MLP and cfg.is_moe_layer(layer):
        raise AdapterError("target_modules", f"layer {layer}'s MLP is a mixture of experts; adapters on experts "
                                             f"are not supported")
    return layer, module, match[4]
