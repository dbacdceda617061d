"""Builds a model from a Hugging Face-style folder (config.json + *.safetensors).

No network and no transformers: the module is built on the meta device and
the checkpoint's tensors are assigned to it, cast to the serving dtype.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open

from ferrum_rpc.errors import StartupError
from ..config import batch_invariant_mode
from ..kernels import qact
from ..kernels import woq
from ..kernels.fused import choose_step_ops
from ..kernels.select import ATEN, ONEDNN_PACKED, KernelChoice, choose_linear, cpu_capability
from .config import ModelConfig
from .linear import replace_linears
from .llama import LINEAR_ROWS, LlamaForCausalLM
from .qwen3 import Qwen3ForCausalLM
from .qwen3_moe import Qwen3MoeForCausalLM, fuse_expert_weights

log = logging.getLogger(__name__)

MODEL_CLASSES = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM, "qwen3_moe": Qwen3MoeForCausalLM}


def return_freed_memory() -> None:
    """Hands the heap memory freed while loading (the checkpoint's float32 tensors,
    the unfused and unpacked originals) back to the OS: glibc keeps freed chunks
    in its arenas otherwise, and they would count as resident for the server's
    lifetime.  A no-op where the C library has no ``malloc_trim``."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def load_model(path: str | Path, dtype: torch.dtype, device: torch.device,
               linear_kernel: str = "auto", quantize: str = "none", step_ops: str = "auto",
               shard=None, batch_invariant: str = "auto",
               overrides: dict[str, torch.Tensor] | None = None) -> LlamaForCausalLM:
    """Loads weights onto ``device`` in ``dtype``, computes the RoPE tables, fuses the
    projections and puts them on the linear kernel probed for this CPU (``kernels/select.py``),
    or quantizes them (``woq.py``); the choice is kept as ``model.kernels``.

    ``shard``: this rank's place in a tensor-parallel group (``parallel.shard.Shard``):
    only its slices are read and built, and it installs its collectives on the model
    (``model.tp`` is then the shard).  ``overrides``: whole checkpoint tensors (by their
    names in the files) to load instead of the files' (an UpdateWeights), converted as
    they are (and sliced, with ``shard``)."""
    path = Path(path)
    cfg = ModelConfig.from_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    start = time.perf_counter()
    if shard is not None:
        if quantize != "none":  # the int8/int4 kernels and the whole-layer decode op assume whole layers
            fallback = f"quantize {quantize} -> none (quantized kernels run unsharded only)"
            if fallback not in shard.fallbacks:  # said once, not again at each UpdateWeights' rebuild
                log.warning("tensor parallel: --quantize %s cannot run sharded; serving %s weights unquantized",
                            quantize, dtype)
                shard.fallbacks += (fallback,)
            quantize = "none"
    if shard is None:
        state = _read_state(files, dtype, device, skip=set(overrides or ()))
    else:
        state = shard.read(files, dtype, device, skip=set(overrides or ()))
        overrides = {name: shard.slice_tensor(name, tensor) for name, tensor in (overrides or {}).items()}
    for name, tensor in (overrides or {}).items():
        state[name] = tensor.to(device=device, dtype=dtype)
    if cfg.num_experts:
        fuse_expert_weights(state, cfg)
    if cfg.tie_word_embeddings or "lm_head.weight" not in state:
        embed = state["model.embed_tokens.weight"]
        state["lm_head.weight"] = embed if shard is None else embed[slice(*shard.vocab)].clone()
    with torch.device("meta"):
        model = MODEL_CLASSES[cfg.architecture](cfg if shard is None else shard.local_config())
        if shard is not None:  # embeddings stay whole on every rank (see parallel/shard.py)
            model.model.embed_tokens = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                                          _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
    model.load_state_dict(state, strict=True, assign=True)
    model.config = cfg
    model.init_rope(device)
    model.eval().requires_grad_(False)
    _choose_kernels(model, path, dtype, device, linear_kernel, quantize, step_ops, batch_invariant)
    if shard is not None:
        shard.install(model)
    params = sum({p.data_ptr(): p.numel() for p in model.parameters()}.values())  # tied count once
    tied = state["lm_head.weight"] is state["model.embed_tokens.weight"]
    params += sum(m.in_features * m.out_features for name, m in model.named_modules()  # quantized or packed
                  if (isinstance(m, woq.QuantizedLinear) or getattr(m, "packed", None) is not None
                      and m.weight is None) and not (name == "lm_head" and tied))
    model.parameter_count = params
    return_freed_memory()
    log.info(
        "loaded %s (%s, %.1fM params%s, %s on %s) in %.1fs", path.name, cfg.architecture, params / 1e6,
        f" in rank {shard.rank}'s shard of {shard.degree}" if shard else "", dtype, device,
        time.perf_counter() - start,
    )
    return model


def _read_state(files: list[Path], dtype: torch.dtype, device: torch.device,
                skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in ``dtype`` on ``device``, but those named in ``skip``."""
    state: dict[str, torch.Tensor] = {}
    for i, f in enumerate(files, 1):
        log.info("loading %s (%d/%d)", f.name, i, len(files))
        with safe_open(f, "pt") as opened:
            names = [n for n in opened.keys() if n.removeprefix("_orig_mod.") not in skip]
            tensors = {n: opened.get_tensor(n) for n in names}
        for name, tensor in tensors.items():
            if "rotary_emb" in name:  # old checkpoints carry inv_freq buffers
                continue
            owned = tensor.to(device=device, dtype=dtype)
            if owned.data_ptr() == tensor.data_ptr():  # still the file's mmap: copy, so the mapping goes
                owned = owned.clone()
            state[name.removeprefix("_orig_mod.")] = owned
    return state


def _choose_kernels(model, path: Path, dtype: torch.dtype, device: torch.device, linear_kernel: str,
                    quantize: str, step_ops: str, batch_invariant: str = "auto") -> None:
    fused, step_why = choose_step_ops(step_ops, dtype, device)
    batch_invariant = batch_invariant_mode(batch_invariant)
    invariant = False
    if batch_invariant != "off":
        why_not = _invariant_blocker(model, dtype, quantize, fused, step_why,
                                     linear_kernel if batch_invariant == "auto" else "auto")
        if why_not and batch_invariant == "on":
            raise StartupError(f"--batch-invariant {why_not}")
        if why_not:
            log.info("%s: not batch-invariant: --batch-invariant %s", path.name, why_not)
        invariant = not why_not
    if invariant:
        if quantize == "none":
            model.kernels = KernelChoice("panel_gemm", "batch-invariant: every row count on one arithmetic",
                                         cpu_capability())
            model.optimize_for_inference(False, rows_kernel=True)
        else:
            model.kernels = _quantize_invariant(model, path, quantize)
        model.use_fused_ops(True)
        model.make_batch_invariant()
    elif quantize == "none":
        model.kernels = choose_linear(linear_kernel, dtype, device)
        # batch-1 linears on linear_rows.cpp's GEMV unless the fallbacks are forced
        rows_kernel = fused and dtype in LINEAR_ROWS and linear_kernel != ATEN
        model.optimize_for_inference(model.kernels.linear == ONEDNN_PACKED, rows_kernel)
        if rows_kernel:
            model.kernels = dataclasses.replace(
                model.kernels, reason=model.kernels.reason + f"; 1-{LINEAR_ROWS[dtype]} rows: linear_rows")
    else:
        model.optimize_for_inference(False)  # fuse projections, then quantize the fused weights
        kernel, why = qact.choose_kernel(linear_kernel)
        two_digits = quantize in ("int8", "int4")
        if two_digits and kernel != qact.QACT:  # where the integer kernel cannot run: float activations (woq.py)
            integer_why = why
            kernel, why = woq.choose_kernel(linear_kernel)
            why += f"; float activations (integer kernel: {integer_why})"
            nbytes = woq.quantize_model(model, 4 if quantize == "int4" else 8, kernel, skip=(".mlp.gate",))
        else:
            nbytes = qact.quantize_model(model, quantize, kernel, skip=(".mlp.gate",))
            if two_digits:
                why += "; activations as two int8 digits per block"
            elif note := qact.rotation_note(model):
                why += f"; {note}"
        model.kernels = KernelChoice(f"{quantize} {kernel}", why, cpu_capability())
        log.info("%s: linear weights quantized to %s: %.1f MiB", path.name, quantize, nbytes / 2**20)
    if not invariant:
        model.use_fused_ops(fused)
    model.kernels = dataclasses.replace(model.kernels, step=step_why)
    log.info("%s: kernel path %s on CPU capability %s", path.name, model.kernels.describe(),
             model.kernels.cpu_capability)


def _quantize_invariant(model, path: Path, quantize: str) -> KernelChoice:
    """Quantizes a batch-invariant model's linears for csrc/qact.cpp's ``block_linear`` in
    every mode (int8 and int4 with two activation digits), whatever ``--linear-kernel``
    asks: it quantizes each activation row on its own grid (per block of 32, never a
    scale over the batch) and sums each output's blocks in one order at any row count,
    while the float-activation kernels (``woq.py``: registers for 1-4 rows, a BLAS GEMM
    past 12) and the torch fallbacks (``F.linear``) change their order with the rows.
    Linears it cannot take (an input width not a multiple of 32) run ``panel_linear``."""
    _, why = qact.choose_kernel("auto")  # QACT: _invariant_blocker asked first
    model.optimize_for_inference(False)  # fuse projections, then quantize the fused weights
    nbytes = qact.quantize_model(model, quantize, qact.QACT, skip=(".mlp.gate",))
    replace_linears(model, "never")  # those left unquantized: panel_linear by make_batch_invariant
    log.info("%s: linear weights quantized to %s: %.1f MiB", path.name, quantize, nbytes / 2**20)
    two_digits = quantize in ("int8", "int4")
    note = "" if two_digits else qact.rotation_note(model)
    return KernelChoice(f"{quantize} {qact.QACT}", f"batch-invariant: activations as "
                        f"{'two int8 digits' if two_digits else 'int8'} per block of each row, every row count on "
                        f"one arithmetic; {why}" + (f"; {note}" if note else ""), cpu_capability())


def _invariant_blocker(model, dtype: torch.dtype, quantize: str, fused: bool, step_why: str,
                       linear_kernel: str) -> str | None:
    """Why this build cannot make the model batch-invariant (a clause that follows
    "--batch-invariant"), or None where it can."""
    if dtype not in LINEAR_ROWS:
        return f"runs float32 or bfloat16, not {dtype}"
    if model.config.num_experts:
        return "does not cover mixture-of-experts models (their experts' GEMMs group tokens by expert)"
    if not fused:
        return f"needs the fused CPU ops, which cannot run here ({step_why})"
    if linear_kernel != "auto":
        return f"needs --linear-kernel auto, not {linear_kernel}"
    if quantize != "none":
        kernel, why = qact.choose_kernel(linear_kernel)
        if kernel != qact.QACT:
            return f"--quantize {quantize} needs csrc/qact.cpp's kernels, which cannot run here ({why})"
    return None