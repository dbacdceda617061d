"""Llama-family decoder (SmolLM2, Llama 2/3 with default RoPE, Mistral without sliding window).

Parameter names mirror Hugging Face's so checkpoints load as they are; the layers
are in ``layers.py``.
"""

from __future__ import annotations

import logging
import math

import torch
from torch import nn

from ..kernels.qact import QACT, UNIT
from ..kernels.rope import rope_tables
from ..kernels.select import packed_float32_wins_at_one_row
from ..kernels.woq import WOQ, QuantizedLinear
from .config import ModelConfig
from .layers import MLP, DecoderLayer, RMSNorm, Rope
from .linear import LINEAR_ROWS, FastLinear, replace_linears

log = logging.getLogger(__name__)


FUSED_MAX_TOKENS = 16  # forwards of up to this many tokens per sequence (decode, short verifies) run fused


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_cls: type[DecoderLayer]):
        super().__init__()
        # given a weight, Embedding skips its random init, whose normal_ on the meta device
        # imports torch._dynamo (~5 s of every load); the checkpoint's weight replaces it anyway
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(layer_cls(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """forward(ids, positions, kv) -> hidden states; ``logits`` projects chosen rows."""

    layer_cls = DecoderLayer

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg, self.layer_cls)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.fused_ops = False  # see use_fused_ops
        self.fused_max_tokens = FUSED_MAX_TOKENS  # tokens per sequence RoPE + attention run fused for
        self.batch_invariant = False  # see make_batch_invariant
        self.layer_ops = None  # the layers as one ferrum_fused.DecodeStack, where every layer qualifies
        self.layer_ops_rows: int | None = None  # the most rows they take (float32 linears: linear_rows'), or any
        self.layer_ops_dtype = torch.float32  # their activations' dtype (bfloat16: every linear on linear_rows)
        self.adapters = None  # a lora.AdapterSet: the LoRA adapters forwards may name per token

    def init_rope(self, device: torch.device) -> None:
        self.rope_cos, self.rope_sin = rope_tables(self.config, device)

    def optimize_for_inference(self, pack_weights: bool, rows_kernel: bool = False) -> None:
        """Fuses projections and, where ``pack_weights`` (the probe in ``kernels/select.py``
        said the oneDNN packed linear runs here), prepacks weights (after loading).
        ``rows_kernel``: float32 and bfloat16 weights will run up to ``LINEAR_ROWS[dtype]``
        rows on linear_rows.cpp's ``linear_rows`` (see ``use_fused_ops``), so their plain
        copies are kept and oneDNN's packed ones serve larger batches only."""
        for module in list(self.modules()):
            if hasattr(module, "fuse"):
                module.fuse()
        weight = self.lm_head.weight
        if rows_kernel and weight.dtype in LINEAR_ROWS:
            log.info("%s linears: 1-%d rows on linear_rows (fused ops), more %s", str(weight.dtype)[6:],
                     LINEAR_ROWS[weight.dtype], "on oneDNN's packed copies" if pack_weights else "on F.linear")
            replace_linears(self, "batched" if pack_weights else "never")
            return
        if not pack_weights:
            return
        if weight.dtype == torch.bfloat16:
            replace_linears(self, "always")
        elif weight.dtype == torch.float32:
            wins, timing = packed_float32_wins_at_one_row()
            log.info("float32 linears: packed for %s (%s)", "every row count" if wins else "batches", timing)
            replace_linears(self, "always" if wins else "batched")

    def use_fused_ops(self, on: bool) -> None:
        """Runs RMSNorm, the MLP activation and (for forwards of up to
        FUSED_MAX_TOKENS tokens per sequence) RoPE + KV write + attention as
        the fused ops of ``csrc/fused.h``; off: the eager torch ops."""
        self.fused_ops = on
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.fused = on
            elif isinstance(module, FastLinear):
                module.rows_kernel = (on and module.weight is not None and module.weight.is_contiguous()
                                      and module.weight.dtype in LINEAR_ROWS)
                module.rows_max = LINEAR_ROWS[module.weight.dtype] if module.rows_kernel else 0
        args = self._whole_layer_args() if on else None
        self.layer_ops = self._decode_stack(args) if args else None

    def make_batch_invariant(self) -> None:
        """Computes every row of every forward the same way, whatever else shares it:
        each float linear on ``panel_linear`` (csrc/panel_gemm.cpp: its weight packed once,
        each output one multiply-add chain over K at any row count), RoPE, the pool write and attention in the fused op for any
        number of tokens (a query's reduction over its keys in one fixed order), the
        per-row fused RMSNorm and activation.  The whole-layer decode op is rebuilt on the
        packed weights and takes forwards of any size: it runs those same ops, so its bits
        equal the per-op path's.  So a token's
        logits do not depend on the batch, the prompt's chunking or the prefix cache.  Needs the fused ops on and the plain
        float32 or bfloat16 weights (``optimize_for_inference(False, rows_kernel=True)``), or linears quantized
        for csrc/qact.cpp (``qact.BlockQ8Linear``, kernel ``QACT``): each activation row quantized on its own
        grid per block, each output's blocks summed in one order whatever the row count; with those the
        whole-layer op takes forwards of any size, its silu*up on the per-row loops (``set_rows_silu``)."""
        if not self.fused_ops:
            raise ValueError("batch invariance runs on the fused ops, which are off")
        for module in self.modules():
            if isinstance(module, FastLinear):
                if module.weight is None or not module.weight.is_contiguous():
                    raise ValueError("batch invariance needs every linear's plain, contiguous weight")
                module.panels = torch.ops.ferrum_fused.pack_panels(module.weight)
            elif isinstance(module, MLP):
                module.invariant = True
            elif isinstance(module, QuantizedLinear):
                if module.kernel != QACT or not hasattr(module, "digits"):
                    raise ValueError(f"batch invariance: quantized linears run {QACT}, not {module.kernel}")
            elif isinstance(module, nn.Linear):
                raise ValueError(f"batch invariance: a linear outside FastLinear ({type(module).__name__})")
        self.fused_max_tokens = 1 << 62
        if self.layer_ops is not None:
            args = self._whole_layer_args()  # the float linears' packed panels now
            self.layer_ops = self._decode_stack(args) if args else None
        if self.layer_ops is not None:
            self.layer_ops.set_rows_silu(True)
        self.batch_invariant = True

    def _decode_stack(self, layer_args: list[tuple]):
        """The layers as one ``ferrum_fused.DecodeStack``: their weights handed over
        once, a decode step one call (csrc/decode_stack.cpp says why)."""
        cfg = self.config
        stack = torch.classes.ferrum_fused.DecodeStack(cfg.num_heads, cfg.num_kv_heads, 1 / math.sqrt(cfg.head_dim))
        for args in layer_args:
            stack.add_layer(*args)
        return stack

    def _whole_layer_args(self) -> list[tuple] | None:
        """Per layer, the weights ``ferrum_fused.decode_layer`` takes, when every layer
        is a plain Llama or Qwen3 block (a dense MLP; Qwen3's q/k RMSNorm in the op) whose projections are all
        our int8/int4 linears without bias (weight-only, or packed ones, whose widths
        are passed negated, with their activation digits) or float linears on
        ``linear_rows`` (bits 32, [weight]: forwards of up to ``layer_ops_rows`` rows) or, batch-invariant,
        on ``panel_linear`` (bits 32, [weight, panels]: any row count); float32 or, all of them, bfloat16:
        ``layer_ops_dtype``; else None (the per-op path runs)."""
        args, rows, dtypes = [], [], set()
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not MLP or not isinstance(layer.input_layernorm, RMSNorm):
                return None
            qk_norm = [attn.q_norm.weight, attn.k_norm.weight] if attn.has_qk_norm else []
            if attn.has_qk_norm and not (isinstance(attn.q_norm, RMSNorm) and isinstance(attn.k_norm, RMSNorm)
                                         and attn.q_norm.eps == attn.k_norm.eps == layer.input_layernorm.eps):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if not all(l.bias is None and ((isinstance(l, QuantizedLinear) and l.kernel in (WOQ, QACT))
                                           or (isinstance(l, FastLinear) and l.rows_kernel)) for l in linears):
                return None
            if any(isinstance(l, QuantizedLinear) and l.kernel == QACT and l.out_features % UNIT for l in linears):
                return None  # the whole-layer op takes every packed unit's 16 outputs
            rows += [l.rows_max for l in linears if isinstance(l, FastLinear) and l.panels is None]
            dtypes |= {l.weight.dtype if isinstance(l, FastLinear) else torch.float32 for l in linears}
            weights = [([l.weight] if l.panels is None else [l.weight, l.panels]) if isinstance(l, FastLinear)
                       else l.kernel_args() for l in linears]
            bits = [32 if isinstance(l, FastLinear) else -l.bits if l.kernel == QACT else l.bits for l in linears]
            args.append((layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                         layer.input_layernorm.eps, *weights, bits,
                         [getattr(l, "digits", 1) for l in linears],
                         [int(getattr(l, "rotated", False)) for l in linears], qk_norm))
        # bfloat16 only where every linear is a bfloat16 FastLinear (the op's linears take float32 otherwise)
        if len(dtypes) != 1:
            return None
        self.layer_ops_rows = min(rows) if rows else None
        self.layer_ops_dtype = dtypes.pop()
        return args

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv,
                capture: dict[int, torch.Tensor | None] | None = None,
                adapter_slots: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: (B, T) int64 -> hidden (B, T, hidden); with a
        ``RaggedBatch`` as ``kv``, input_ids (1, N) -> hidden (1, N, hidden) and
        ``positions`` is unused (each group has its own).

        ``capture``: layer indices (as transformers' ``output_hidden_states``: 0 the
        embeddings, i the output of layer i, num_layers the normed output) whose
        hidden states are copied into it.

        ``adapter_slots``: per token (shaped as ``input_ids``) or per sequence (B,), the
        slot in ``self.adapters`` of the LoRA adapter it runs with, -1 the base model;
        None: the base model everywhere."""
        if capture is None and adapter_slots is None and self._whole_step(input_ids, positions, kv):
            # the embedding, every layer and the final norm in one call to the stack
            pool, norm = kv.pool, self.model.norm
            self._stack_scales(pool)
            return self.layer_ops.forward_ids(input_ids, self.model.embed_tokens.weight, norm.weight, norm.eps,
                                              self.rope_cos, self.rope_sin, kv.positions, pool.k, pool.v,
                                              kv.write_slots, kv.tables)
        x = self.model.embed_tokens(input_ids)  # (B, T, C)
        lora = None if adapter_slots is None else self.adapters.deltas(adapter_slots, input_ids.shape)
        if getattr(kv, "ragged", False):  # input_ids (1, N): every group's tokens, see kv.pool.RaggedBatch
            ropes = [self.rope(group.positions, x.dtype) for group, *_ in kv.groups]
            for i, layer in enumerate(self.model.layers):
                x = layer(x, ropes, kv, None if lora is None else lora.layers[i])
            return self.model.norm(x)
        keep = (lambda i, h: capture.__setitem__(i, h.clone()) if i in capture else None) if capture else None
        if keep:
            keep(0, x)
        rope = self.rope(positions, x.dtype, eager=getattr(kv, "attention", None) is not None)
        if (self._stack_takes(positions, x.dtype, x.shape[0] * x.shape[1], kv)
                and (lora is None or lora.batch is not None)):
            pool, n = kv.pool, len(self.model.layers)
            self._stack_scales(pool)
            step = (self.rope_cos, self.rope_sin, kv.positions, pool.k, pool.v, kv.write_slots, kv.tables)
            if lora is None:
                run = self.layer_ops.forward
            else:  # each token's LoRA delta after each linear, in the stack (lora.cpp)
                run = lambda *args: self.layer_ops.forward_lora(*args, lora.batch)  # noqa: E731
            if keep:  # a layer a call, to copy each one's output
                for i in range(n):
                    x = run(x, *step, i, i + 1)
                    if i + 1 < n:
                        keep(i + 1, x)
            else:
                x = run(x, *step, 0, n)
        else:
            for i, layer in enumerate(self.model.layers):
                x = layer(x, rope, kv, None if lora is None else lora.layers[i])
                if keep and i + 1 < len(self.model.layers):
                    keep(i + 1, x)
        out = self.model.norm(x)
        if keep:
            keep(len(self.model.layers), out)
        return out

    def _stack_scales(self, pool) -> None:
        """Gives the stack an int8 pool's scales (it reads and writes them beside the values)."""
        if pool.quantized:
            self.layer_ops.set_kv_scales(pool.k_scale, pool.v_scale)

    def _stack_takes(self, positions: torch.Tensor, dtype: torch.dtype, rows: int, kv) -> bool:
        """Whether the stack (``layer_ops``) runs every layer of a padded forward of ``rows``
        tokens at ``positions`` (B, T), activations in ``dtype`` (LoRA aside): fused RoPE
        and attention (fused ops on, T within ``fused_max_tokens``, no eager attention)
        and a batch the stack takes."""
        return (self.layer_ops is not None and dtype == self.layer_ops_dtype and self.fused_ops
                and positions.shape[1] <= self.fused_max_tokens and getattr(kv, "attention", None) is None
                and (self.layer_ops_rows is None or rows <= self.layer_ops_rows))

    def _whole_step(self, input_ids: torch.Tensor, positions: torch.Tensor | None, kv) -> bool:
        """Whether ``forward`` would run the embedding, the stack over every layer and the
        fused final norm, one after the other (so ``DecodeStack.forward_ids`` does it)."""
        return (positions is not None and not getattr(kv, "ragged", False) and self.model.norm.fused
                and self._stack_takes(positions, self.model.embed_tokens.weight.dtype, input_ids.numel(), kv))

    def rope(self, positions: torch.Tensor, dtype: torch.dtype, eager: bool = False) -> Rope:
        """The rotary embedding for tokens at ``positions`` (B, T): fused for up to
        FUSED_MAX_TOKENS tokens per sequence when the fused ops are on (and not ``eager``)."""
        if self.fused_ops and positions.shape[1] <= self.fused_max_tokens and not eager:
            return Rope(None, None, self.rope_cos, self.rope_sin, fused=True)
        return Rope(self.rope_cos[positions].unsqueeze(2).to(dtype),  # (B, T, 1, D)
                    self.rope_sin[positions].unsqueeze(2).to(dtype), self.rope_cos, self.rope_sin, fused=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden (N, C) -> float32 logits (N, V)."""
        out = self.lm_head(hidden)
        return out if out.dtype == torch.float32 else out.float()
