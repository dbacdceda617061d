"""Quantized weights *and* activations, multiplied in integers: ``--quantize w8a8|w4a8``.

The weight-only modes (``woq.py``) expand every weight code to float32 and
multiply with float FMAs: compute-bound at ~20 G weights/s on two cores, and
slower than float32 at 32 rows.  These modes quantize each activation row on
every call and multiply bytes by bytes, as llama.cpp does:

* **w8a8**: int8 weights per output channel (symmetric, ``amax / 127``),
  activations per token row to 7 bits (fbgemm's range on AVX2, whose
  ``vpmaddubsw`` saturates int16 with full 8-bit activations).  Kernel:
  torch's own fbgemm dynamic linear (``torch.ops.quantized``, the x86
  engine).  Measured on the 2-core AVX2 EPYC (busy host, best of 20, ms),
  SmolLM2's shapes, rows 1 / 8 / 32:

  ===========  =================  =================  =================  ==================
  layer        F.linear f32       f32 packed         int8 (woq)         fbgemm dynamic
  ===========  =================  =================  =================  ==================
  LM head      12.1 / 99 / 156    14.5 / 24 / 68     7.3 / 22 / 84      7.0 / 10.6 / 30
  gate|up      0.67 / 2.1 / 3.5   0.31 / 0.87 / 1.9  0.22 / 0.73 / 2.4  0.11 / 0.44 / 1.7
  down         0.11 / 0.46 / 1.1  0.14 / 0.33 / 1.1  0.13 / 0.37 / 1.9  0.08 / 0.25 / 0.83
  ===========  =================  =================  =================  ==================

  fbgemm is the fastest at every row count, so it is used; our own kernel
  was not written for this mode.  fbgemm quantizes a whole call's input with
  one range; to keep each row's numbers independent of the batch it shares,
  rows are scaled to ``amax = 1`` first and quantized with a fixed grid
  (``linear_with_input_q_dq_qweight_dq_output_fp32``), then scaled back.  A
  single row skips that (one call's range *is* the row's): ~60 us less per
  linear, 7 ms a step at batch 1.  Fallback (``torch-int8``, where fbgemm is
  missing or disagrees): the same quantized numbers in float32 torch ops.
* **w4a8**: the 4-bit codes, scales and minimums of the int4 mode (GGUF's
  Q4_1 blocks of 32, held without loss; the LM head stays 8-bit, GGUF's
  Q8_0), activations per block of 32 to int8 (llama.cpp's Q8_1).  Neither
  torch nor torchao has a CPU kernel for this (torchao's int4 CPU layout
  calls ``_weight_int4pack_mm_for_cpu``, which expands to float), so
  ``csrc/qact.cpp`` is ours: AVX2 ``vpmaddubsw``/``vpmaddwd`` and a portable
  path, probed at load.  Fallback (``torch-q8``): activations fake-quantized
  per block in torch, then ``F.linear`` over the dequantized weights.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from ferrum_rpc.server import woq

log = logging.getLogger(__name__)

FBGEMM, TORCH_INT8 = "fbgemm-dynamic", "torch-int8"  # w8a8 kernels
QACT, TORCH_Q8 = "ferrum-qact", "torch-q8"  # w4a8 kernels
_ACT_LEVELS = 63  # w8a8 activation grid: 7 bits, symmetric (fbgemm's reduce_range on x86)
# Relative error (of the output's max) a probe accepts against a float reference: the
# activation grid alone gives ~1/127 (w4a8) and ~1/63 (w8a8) of a row's amax per element.
_PROBE_TOLERANCE = {8: 0.03, 4: 0.02}


def fake_quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) rounded to int8 codes per block of 32 (``amax / 127``), back in float32."""
    blocks = x.float().unflatten(-1, (-1, woq.GROUP))  # (..., K/32, 32)
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, 0.0)  # times the reciprocal, as csrc/qact.cpp: the same codes
    return ((blocks * inv).round() * d).flatten(-2)


class BlockQ8Linear(woq.QuantizedLinear):
    """An int4/int8 block-quantized linear (``woq.QuantizedLinear``'s storage)
    whose activations are quantized per block of 32 to int8: ``--quantize w4a8``.

    Args: as ``QuantizedLinear``; kernel ``"ferrum-qact"`` (csrc/qact.cpp) or ``"torch-q8"``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.kernel == QACT:
            y = torch.ops.ferrum_qact.block_linear(xf, self.qweight, self.scales, self.mins, self.bits)
        else:
            y = F.linear(fake_quantize_blocks(xf), self.dequantized())
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class DynamicInt8Linear(nn.Module):
    """int8 weights per output channel, activations quantized per row on each
    call: ``--quantize w8a8``.  Inputs and outputs in the serving dtype.

    Args:
        weight: (N, K) in any float dtype.
        kernel: ``"fbgemm-dynamic"`` (torch.ops.quantized) or ``"torch-int8"`` (the fallback).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: str):
        super().__init__()
        self.kernel, (self.out_features, self.in_features) = kernel, weight.shape
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        codes = (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)
        self.register_buffer("scales", scales)
        if kernel == FBGEMM:
            qweight = torch._make_per_channel_quantized_tensor(codes, scales.double(),
                                                               torch.zeros_like(scales, dtype=torch.long), 0)
            self._packed = torch.ops.quantized.linear_prepack(qweight, self.bias)
            self.codes = None
        else:
            self.register_buffer("codes", codes)

    @classmethod
    def from_linear(cls, linear: nn.Module, kernel: str) -> DynamicInt8Linear:
        return cls(linear.weight.data, None if linear.bias is None else linear.bias.data, kernel)

    @property
    def nbytes(self) -> int:
        return self.out_features * self.in_features + self.scales.numel() * 4

    def int8_codes(self) -> torch.Tensor:
        if self.codes is not None:
            return self.codes
        return torch.ops.quantized.linear_unpack(self._packed)[0].int_repr()

    def dequantized(self) -> torch.Tensor:
        """The float32 weight this layer computes with."""
        return self.int8_codes().float() * self.scales[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float().reshape(-1, self.in_features)  # (M, K)
        if self.kernel == FBGEMM and len(xf) == 1:  # one call's range is this row's
            y = torch.ops.quantized.linear_dynamic(xf, self._packed, True)
        else:
            amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
            if self.kernel == FBGEMM:  # rows scaled to amax 1, one fixed grid for all
                y = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(
                    xf / amax, 1 / _ACT_LEVELS, _ACT_LEVELS + 1, self._packed)
                y = (y - (0 if self.bias is None else self.bias)) * amax
            else:
                q = (xf * (_ACT_LEVELS / amax)).round()
                y = F.linear(q, self.codes.float()) * (amax / _ACT_LEVELS) * self.scales
            if self.bias is not None:
                y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, w8a8, kernel={self.kernel}"


# -- probing --------------------------------------------------------------------------------
def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)


@functools.lru_cache(maxsize=None)
def probe(mode: str) -> tuple[bool, str]:
    """Whether the fast kernel for ``mode`` ("w8a8": fbgemm; "w4a8": csrc/qact.cpp)
    runs here and agrees with a float reference.  Returns (ok, reason); never raises."""
    try:
        if mode == "w8a8":
            engines = torch.backends.quantized.supported_engines
            if "x86" not in engines and "fbgemm" not in engines:
                return False, f"torch has no fbgemm quantized engine here ({engines})"
        else:
            woq.load_library()
        gen = torch.Generator().manual_seed(0)
        weight = torch.randn(40, 96, generator=gen)
        layers = ([DynamicInt8Linear(weight, None, FBGEMM)] if mode == "w8a8" else
                  [BlockQ8Linear(weight, None, bits, QACT) for bits in (4, 8)])
        for layer in layers:
            for rows in (1, 3, 5, 12):  # one row and batches take different calls
                x = torch.randn(rows, 96, generator=gen)
                err = _relative_error(layer(x), F.linear(x, layer.dequantized()))
                if not err <= _PROBE_TOLERANCE[8 if mode == "w8a8" else 4]:
                    return False, f"{mode} kernel disagrees with the float reference (relative error {err:.2e})"
    except Exception as exc:  # any failure of a private op or our build means "not here"
        return False, f"{type(exc).__name__}: {str(exc)[:300]}"
    if mode == "w8a8":
        return True, f"fbgemm probed OK (torch.ops.quantized, {torch.backends.quantized.engine} engine)"
    return True, f"built and probed OK ({torch.ops.ferrum_woq.isa()} inner loops)"


def choose_kernel(mode: str, requested_linear: str) -> tuple[str, str]:
    """(kernel, reason) for ``mode``'s layers; ``requested_linear == "aten"`` forces the torch fallback."""
    fast, fallback = (FBGEMM, TORCH_INT8) if mode == "w8a8" else (QACT, TORCH_Q8)
    if requested_linear == "aten":
        return fallback, "forced by configuration"
    ok, why = probe(mode)
    return (fast, why) if ok else (fallback, f"fallback: {why}")


def quantize_model(model: nn.Module, mode: str, kernel: str, skip: tuple[str, ...] = ()) -> int:
    """Replaces every ``nn.Linear`` with a ``mode`` layer, in place (the LM head is
    8-bit in w4a8, as in int4); modules named with a suffix in ``skip`` keep their
    weights.  Returns the bytes the quantized weights take."""
    if mode == "w4a8":
        return woq.quantize_model(model, 4, kernel, skip, cls=BlockQ8Linear)
    total = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is not nn.Linear:
                continue
            if full.endswith(skip):
                log.info("%s stays unquantized", full)
                continue
            layer = DynamicInt8Linear.from_linear(child, kernel)
            setattr(parent, name, layer)
            total += layer.nbytes
    return total
