"""Quantized weights: the grids of ``--quantize int8|int4`` (and of w8a8/w4a8), and
the kernels that multiply them with float activations.

Linear weights are stored quantized in groups of 32 along the input; the KV
cache stays in the serving dtype.  Where ``csrc/qact.cpp`` builds and probes
OK, int8 and int4 layers run there (``qact.TwoDigitLinear``: activations as two
int8 digits per block, about 15 bits, multiplied in integers; faster than this
file's float kernels and as accurate, see docs/performance.md); this file's ``ferrum-woq`` kernels, on activations in
the serving dtype, are their fallback there, and ``torch-dequant`` the last one.

Every group has a scale and a minimum, ``w = code * scale + min``:

* **int4**: codes 0..15, a block's minimum mapped to 0 and its maximum to 15:
  GGUF's Q4_1 layout, exactly as llama.cpp quantizes it, so the embedded
  model's Q4_1 projections come back to the same codes (no further loss).
* **int8**: codes 0..255; each group takes whichever of two grids fits it
  better: min-to-max in 255 steps (holds Q4_1 blocks exactly: code = 17 q)
  or symmetric ``amax / 127`` steps with ``min = -128 * scale`` (holds GGUF's
  Q8_0 blocks exactly).  So int8 is lossless on the embedded GGUF too.
* The LM head stays int8 in int4 mode: the embedded GGUF ties it to a Q8_0
  token embedding, and llama.cpp runs it at 8 bits.

Kernels, chosen by probing once per process (``probe_woq``):

* ``ferrum-woq``: ``csrc/woq.cpp``, compiled with the system C++ compiler
  the first time it is needed and cached under ``$FERRUM_RPC_HOME/kernels``
  (``build.py``, keyed by source, torch version and compiler).  Measured on the 2-core
  AVX2 and AVX-512 EPYCs, torch's own weight-only ops
  (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``,
  ``_dyn_quant_matmul_4bit``) run 1.5-5x slower than float32 at one row and
  20-100x slower at 32 rows, and int8pack has no groups; torchao's CPU int4
  layout calls the same op.  That is why this file exists.
* ``torch-dequant``: expands a block of weight rows with torch ops and calls
  ``F.linear``, per call: the same numbers as the extension, correct
  everywhere, slower.  The fallback where the extension cannot be built or
  disagrees with the reference, and what ``--linear-kernel aten`` forces.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .build import load_library
from .probe import TOLERANCE, Verdict, as_probe, built, check
from ..config import QUANTIZATIONS  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

GROUP = 32  # int4 group length along the input dimension (GGUF Q4_1's block)
WOQ, DEQUANT = "ferrum-woq", "torch-dequant"
_DEQUANT_ROWS = 4096  # weight rows expanded at a time by the fallback (bounds its temporary memory)


# -- probing the extension -------------------------------------------------------------------
@as_probe()
def probe_woq() -> Verdict:
    """Whether our int8/int4 kernels build, load and agree with the reference here.

    Returns (ok, reason).  Never raises: any failure is a "no" and the torch
    ops serve instead.
    """
    load_library()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen)
    for bits in (8, 4):
        layer = QuantizedLinear(weight, None, bits, WOQ)
        reference = layer.dequantized()
        for rows in (1, 3, 5, 12, 20):  # every kernel shape: registers, L1 rows, GEMM tiles
            x = torch.randn(rows, 96, generator=gen)
            check(layer(x), F.linear(x, reference), TOLERANCE[torch.float32],
                        f"int{bits} kernel disagrees with the reference")
    return True, built(torch.ops.ferrum_woq.isa())


def choose_kernel(requested_linear: str) -> tuple[str, str]:
    """(kernel, reason) for quantized layers; ``requested_linear == "aten"`` forces torch's ops."""
    if requested_linear == "aten":
        return DEQUANT, "forced by configuration"
    ok, why = probe_woq()
    return (WOQ, why) if ok else (DEQUANT, f"fallback: {why}")


# -- quantizing ---------------------------------------------------------------------------
def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) -> codes (N, K) uint8, scales and minimums (N, K/32) float32; per group the
    better of the min-to-max grid and the symmetric grid (see the module docstring)."""
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    tiny = torch.finfo(torch.float32).tiny
    lo, hi = w.amin(dim=-1, keepdim=True), w.amax(dim=-1, keepdim=True)
    grids = []
    for scale, low in (((hi - lo) / 255, lo), (None, None)):
        if scale is None:  # symmetric: amax / 127, codes 1..255 around 128
            scale = (w.abs().amax(dim=-1, keepdim=True) / 127).clamp_min(tiny)
            low = -128 * scale
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = ((w - low) / scale).round().clamp(0, 255)
        grids.append((codes, scale, low, (codes * scale + low - w).abs().amax(dim=-1, keepdim=True)))
    (qa, sa, la, ea), (qs, ss, ls, es) = grids
    pick = es < ea  # (N, G, 1)
    codes, scales, mins = torch.where(pick, qs, qa), torch.where(pick, ss, sa), torch.where(pick, ls, la)
    return (codes.to(torch.uint8).view(n, k).contiguous(), scales.squeeze(-1).contiguous(),
            mins.squeeze(-1).contiguous())


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(N, K) -> codes (N, K) uint8 in 0..15, scales and minimums (N, K/32) float32.

    A block's minimum maps to 0 and its maximum to 15, exactly as GGUF's Q4_1
    quantizer does, so Q4_1-dequantized weights come back to the same codes.
    """
    n, k = weight.shape
    w = weight.float().view(n, k // GROUP, GROUP)
    lo, hi = w.amin(dim=-1), w.amax(dim=-1)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = ((w - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8)
    return q.view(n, k), scales.contiguous(), lo.contiguous()


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """(N, K) codes -> (N, K/2) bytes; byte i of each 32-block holds codes i (low) and i + 16 (high)."""
    n, k = codes.shape
    blocks = codes.view(n, k // GROUP, GROUP)
    return (blocks[..., :GROUP // 2] | (blocks[..., GROUP // 2:] << 4)).reshape(n, k // 2).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    n, half = packed.shape
    blocks = packed.view(n, half * 2 // GROUP, GROUP // 2)
    return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(n, half * 2)


class QuantizedLinear(nn.Module):
    """``F.linear`` over int8 or int4 weights in groups of 32; inputs and outputs in the serving dtype.

    Args:
        weight: (N, K) in any float dtype; K must be a multiple of 32.
        bits: 8 or 4.
        kernel: ``"ferrum-woq"`` (csrc/woq.cpp) or ``"torch-dequant"`` (the fallback).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, bits: int, kernel: str):
        super().__init__()
        n, k = weight.shape
        if k % GROUP:
            raise ValueError(f"quantized weights need an input size divisible by {GROUP}, got {k}")
        if bits not in (4, 8):
            raise ValueError(f"bits must be 8 or 4, not {bits}")
        self.bits, self.kernel, self.out_features, self.in_features = bits, kernel, n, k
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._store(*(quantize_int8(weight) if bits == 8 else quantize_int4(weight)))

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        """Keeps codes (N, K) uint8, scales and minimums (N, K/32) in this kernel's layout."""
        self.register_buffer("qweight", codes if self.bits == 8 else pack_int4(codes))
        self.register_buffer("scales", scales)
        self.register_buffer("mins", mins)

    @classmethod
    def from_linear(cls, linear: nn.Module, bits: int, kernel: str) -> QuantizedLinear:
        return cls(linear.weight.data, None if linear.bias is None else linear.bias.data, bits, kernel)

    def kernel_args(self) -> list[torch.Tensor]:
        """The weight tensors ``ferrum_fused.decode_layer`` takes for this linear."""
        return [self.qweight, self.scales, self.mins]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight rows this layer computes with."""
        q = self.qweight[rows]
        codes = (q if self.bits == 8 else unpack_int4(q)).float().view(len(q), -1, GROUP)
        return (codes * self.scales[rows][..., None] + self.mins[rows][..., None]).view(len(q), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        if self.kernel == WOQ:
            ops = torch.ops.ferrum_woq
            if self.bits == 8:
                y = ops.int8_linear(xf, self.qweight, self.scales, self.mins)
            else:
                y = ops.int4_linear(xf, self.qweight, self.scales, self.mins)
        else:
            y = torch.cat([F.linear(xf, self.dequantized(slice(r, r + _DEQUANT_ROWS)))
                           for r in range(0, self.out_features, _DEQUANT_ROWS)], dim=-1)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, int{self.bits}, kernel={self.kernel}"


def quantize_model(model: nn.Module, bits: int, kernel: str, skip: tuple[str, ...] = (),
                   cls: type[QuantizedLinear] = QuantizedLinear, head_cls: type[QuantizedLinear] | None = None) -> int:
    """Replaces every ``nn.Linear`` (and packed linear) with a quantized one, in place.

    The LM head is quantized to int8 even in int4 mode; modules whose name
    ends with one of ``skip`` (MoE routers) keep their weights.  ``cls``: the
    layer type (``qact.BlockQ8Linear`` for w4a8), ``head_cls`` the LM head's (default
    ``cls``).  Returns the bytes the
    quantized weights take.
    """
    total = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if not hasattr(child, "weight") or isinstance(child, (nn.Embedding, QuantizedLinear)):
                continue
            if not isinstance(child, nn.Linear) and type(child).__name__ != "FastLinear":
                continue
            if full.endswith(skip) or child.weight.shape[1] % GROUP:
                log.info("%s stays unquantized", full)
                continue
            head = full == "lm_head"
            layer = ((head_cls or cls) if head else cls).from_linear(child, 8 if head else bits, kernel)
            setattr(parent, name, layer)
            total += layer.nbytes
    return total
