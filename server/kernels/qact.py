"""Quantized weights *and* activations, multiplied in integers: ``--quantize w8a8|w4a8``,
and ``int8|int4`` with two activation digits.  Each activation row is quantized on
every call and multiplied bytes by bytes, as llama.cpp does (``woq.py``'s float
kernels expand every weight code to float32 instead).

* **w8a8**: the int8 mode's weights (groups of 32 with scale and minimum, GGUF's
  Q4_1 and Q8_0 blocks held without loss), activations as w4a8's.
* **w4a8**: the 4-bit codes, scales and minimums of the int4 mode (Q4_1 blocks of 32;
  the LM head stays 8-bit, Q8_0), activations to int8 with a step per half block of
  16.  ``csrc/qact.cpp`` runs both over weight rows packed 8 to a group and
  interleaved per block (``pack_rows``): AVX-512 VNNI or AVX-VNNI ``vpdpbusd``, AVX2
  ``vpmaddwd`` over int16 activations (two digits, 8-bit codes) or ``vpmaddubsw``
  (4-bit codes, one digit), or portable C++, whichever the CPU has, probed at load.
  Fallback (``torch-q8``): activations fake-quantized per block in torch, then
  ``F.linear`` over the dequantized weights.
* **w8a8's rotation** (``RotatedQ8Linear``): each 16 activation elements are rotated
  by ``rotate16`` (a Hadamard matrix of order 16 whose rows all sum to 4, over 4)
  before their 8-bit step, spreading an outlier over its half block; the weights are
  rotated once at load by the same matrix, so the product is unchanged, and stay
  integer codes of one 8-bit grid per block (``rotate_codes``).  A linear whose
  blocks do not rotate into 8 bits stays unrotated.
* **int8, int4** (``TwoDigitLinear``): the same weights, each activation element as
  two int8 digits per block (x ~ (128 q + q') d / 128, error at most amax / 32512),
  summed in integers as 128 dot(w, q) + dot(w, q'): float-like accuracy at twice the
  dot instructions.

Why these choices (the accuracy and speed measured for each alternative) is in
docs/performance.md, "Quantized activations".
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import woq
from .build import load_library
from .probe import Verdict, as_probe, built, check

log = logging.getLogger(__name__)

QACT, TORCH_Q8 = "ferrum-qact", "torch-q8"  # kernels: csrc/qact.cpp, or the torch fallback
# Relative error (of the output's max) a probe accepts against a float reference, by
# activation digits: the grid alone gives up to 1/254 (one digit) or 1/32512 (two) of a
# block's amax per element, averaging out.
_PROBE_TOLERANCE = {1: 0.02, 2: 2e-4}


def fake_quantize_blocks(x: torch.Tensor, digits: int = 1) -> torch.Tensor:
    """x (..., K) rounded to int8 codes (``amax / 127``) per half block of 16, back
    in float32; with two digits, per block of 32 plus the remainder on a grid 128
    times finer (as csrc/qact.cpp)."""
    blocks = x.float().unflatten(-1, (-1, woq.GROUP if digits == 2 else woq.GROUP // 2))
    d = blocks.abs().amax(dim=-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, 0.0)  # times the reciprocal, as csrc/qact.cpp: the same codes
    q = (blocks * inv).round()
    out = q * d
    if digits == 2:
        out = out + ((blocks - out) * inv * 128).round().clamp(-127, 127) * (d / 128)
    return out.flatten(-2)


def _hadamard16(v: torch.Tensor) -> torch.Tensor:
    """(..., K) -> each 16 elements, read as a 4x4 matrix X, to H4 X H4 (H4 = J - 2I):
    x times H4 (x) H4, unnormalised, in csrc/qact.cpp rotate16's order (columns, then
    rows; integers stay exact)."""
    v = v.unflatten(-1, (-1, 4, 4))  # (..., K/16, a, b)
    t = ((v[..., 0, :] + v[..., 1, :]) + (v[..., 2, :] + v[..., 3, :]))[..., None, :] - (v + v)  # H4 X
    return (((t[..., 0] + t[..., 1]) + (t[..., 2] + t[..., 3]))[..., None] - (t + t)).flatten(-3)  # (H4 X) H4


def rotate16(x: torch.Tensor) -> torch.Tensor:
    """x (..., K) float32 times the orthonormal, symmetric, self-inverse (H4 (x) H4) / 4
    per 16 elements: the same floats as csrc/qact.cpp's rotate16."""
    return _hadamard16(x.float()) * 0.25


def rotate_codes(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """8-bit weights ``code * s + m`` (N, K), (N, K/32) -> the same grid's form of
    the rotated weights ``rotate16(w)``, exactly, or None where a block does not fit.

    Per 16 codes the rotation is ``H c / 4 + m`` (rows of H sum to 4), with ``H c`` an
    integer vector r; per block, ``r = g c' + low`` with g the gcd of ``r - low``,
    so ``w' = (s g / 4) c' + (m + s low / 4)``, whose codes c' fit 8 bits when the
    block had few levels (Q4_1's 17 q: |c'| <= 240), not when it was quantized from
    float (all 256)."""
    n, k = codes.shape
    r = _hadamard16(codes.long()).view(n, k // 32, 32)
    low = r.amin(dim=-1)
    span = r - low[..., None]
    g = span[..., 0]
    for i in range(1, 32):
        g = torch.gcd(g, span[..., i])
    g = g.clamp_min(1)  # a constant block: every code 0
    rotated = span // g[..., None]
    if rotated.max() > 255:
        return None
    s = scales.double()
    return (rotated.to(torch.uint8).view(n, k), (s * g / 4).float(), (mins.double() + s * low / 4).float())


LANES = 8  # weight rows interleaved per block and 256-bit register (csrc/qact.cpp)
UNIT = 2 * LANES  # rows stored together: two groups of 8, one 512-bit register


def pack_rows(codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, bits: int,
              dtype: torch.dtype = torch.float16) -> tuple[torch.Tensor, torch.Tensor]:
    """codes (N, K) uint8, scales and minimums (N, K/32) -> csrc/qact.cpp's layout.

    Rows go in groups of 8, interleaved per block of 32 four codes at a time (word k
    of a group: row r's codes 4k..4k+3 in bytes 4r..4r+3; 4-bit: byte b of row r's
    word k holds codes 4k+b and 16+4k+b), and groups in pairs (units of 16 rows)
    whose words alternate: unit u, block g is [word 0 of group 2u, word 0 of group
    2u+1, word 1 of 2u, ...], 32 bytes each, so one 512-bit load takes word k of
    16 rows and a unit's weights are one contiguous stream.  Codes
    (ceil(N/16), K/32, 16 * 32 * bits / 8); scales and minimums
    (ceil(N/16), K/32, 2, 16) in ``dtype`` (float16 or float32): the 16 rows' scales,
    then their minimums.  Rows past N are zero (their outputs are never written)."""
    n, k = codes.shape
    units, pad = -(-n // UNIT), -n % UNIT
    groups, g = 2 * units, k // woq.GROUP
    c = F.pad(codes, (0, 0, 0, pad))
    if bits == 4:
        c = c.view(groups, LANES, g, 2, 4, 4).permute(0, 2, 3, 4, 1, 5)  # j, g, half, k, r, b
        words = (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(groups, g, 4, 32)
    else:
        words = c.view(groups, LANES, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(groups, g, 8, 32)  # j, g, k, (r, b)
    packed = words.view(units, 2, g, -1, 32).permute(0, 2, 3, 1, 4).reshape(units, g, -1)  # u, g, k, h, (r, b)
    sm = F.pad(torch.stack([scales, mins]), (0, 0, 0, pad)).view(2, units, UNIT, g).permute(1, 3, 0, 2)
    return packed.contiguous(), sm.to(dtype).contiguous()


def float16_holds(scales: torch.Tensor, mins: torch.Tensor, bits: int, tolerance: float = 1e-5) -> bool:
    """Whether float16 scales and minimums give every block's weights (``code * s + m``)
    within ``tolerance`` of its magnitude: true for GGUF's blocks (which keep them
    in float16), false for the 8-bit grid over Q4_1 blocks (s = d / 17) and for
    most weights quantized from float, which then keep float32."""
    top = 2**bits - 1
    err = top * (scales.half().float() - scales).abs() + (mins.half().float() - mins).abs()
    return bool((err <= tolerance * (top * scales.abs() + mins.abs())).all())


def unpack_rows(packed: torch.Tensor, packed_scales: torch.Tensor, bits: int, n: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of ``pack_rows``: codes (N, K) uint8, scales and minimums (N, K/32) float32."""
    units, g, _ = packed.shape
    groups = 2 * units
    words = packed.view(units, g, -1, 2, 32).permute(0, 3, 1, 2, 4).reshape(groups, g, -1)  # j, g, (k, r, b)
    if bits == 4:
        p = words.view(groups, g, 4, LANES, 4)
        c = torch.stack([p & 0xF, p >> 4], dim=2).permute(0, 4, 1, 2, 3, 5)  # j, r, g, half, k, b
    else:
        c = words.view(groups, g, 8, LANES, 4).permute(0, 3, 1, 2, 4)  # j, r, g, k, b
    sm = packed_scales.float().permute(2, 0, 3, 1).reshape(2, units * UNIT, g)[:, :n]
    return c.reshape(groups * LANES, -1)[:n], sm[0], sm[1]


class BlockQ8Linear(woq.QuantizedLinear):
    """An int4/int8 block-quantized linear (``woq.QuantizedLinear``'s grids)
    whose activations are quantized to int8, a step per half block of 16: ``--quantize w8a8|w4a8``.

    Scales and minimums are held in float16, GGUF's own width, where that moves
    no weight by more than float32 rounding (``float16_holds``: GGUF's Q4_1 and
    Q8_0 blocks), else in float32; with the ``"ferrum-qact"`` kernel the codes
    are held in csrc/qact.cpp's packed layout only (``pack_rows``), with
    ``"torch-q8"`` as the int4/int8 modes hold them.

    Args: as ``QuantizedLinear``; kernel ``"ferrum-qact"`` (csrc/qact.cpp) or ``"torch-q8"``.
    """

    digits = 1  # int8 codes per activation element
    rotated = False  # activations through rotate16 first, against weights rotated at load (RotatedQ8Linear)

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        half = float16_holds(scales, mins, self.bits)
        if half:
            scales, mins = scales.half().float(), mins.half().float()
        if self.kernel != QACT:
            return super()._store(codes, scales, mins)
        packed, packed_scales = pack_rows(codes, scales, mins, self.bits, torch.float16 if half else torch.float32)
        self.register_buffer("packed", packed)
        self.register_buffer("packed_scales", packed_scales)

    def held(self, rows: slice = slice(None)) -> torch.Tensor:
        """The float32 weight rows the kernel multiplies: rotated ones where ``rotated``."""
        if self.kernel != QACT:
            return super().dequantized(rows)
        codes, scales, mins = unpack_rows(self.packed, self.packed_scales, self.bits, self.out_features)
        blocks = codes[rows].float().unflatten(-1, (-1, woq.GROUP))
        return (blocks * scales[rows][..., None] + mins[rows][..., None]).flatten(-2)

    def dequantized(self, rows: slice = slice(None)) -> torch.Tensor:
        held = self.held(rows)
        return rotate16(held) if self.rotated else held  # the rotation is its own inverse

    def kernel_args(self) -> list[torch.Tensor]:
        if self.kernel != QACT:
            return super().kernel_args()
        return [self.packed, self.packed_scales]  # with -bits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x if x.dtype == torch.float32 else x.float()  # no dispatch where it would change nothing
        if self.kernel == QACT:
            y = torch.ops.ferrum_qact.block_linear(xf, self.packed, self.packed_scales, self.bits, self.out_features,
                                                   self.digits, self.rotated)
        else:
            y = F.linear(fake_quantize_blocks(rotate16(xf) if self.rotated else xf, self.digits), self.held())
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias.to(y.dtype)


class TwoDigitLinear(BlockQ8Linear):
    """``BlockQ8Linear`` with every activation element as two int8 digits per block
    of 32, x ~ (128 q + q') d / 128 (error <= amax / 32512, about 15 bits):
    ``--quantize int8|int4`` on the integer kernels, whose dot instructions it doubles."""

    digits = 2


class RotatedQ8Linear(BlockQ8Linear):
    """``BlockQ8Linear`` (8-bit weights, one activation digit) whose activations
    are rotated by ``rotate16`` before they are quantized, against weights rotated
    at load without loss (``rotate_codes``): w8a8's projections.  Where a block's
    rotated codes do not fit 8 bits the layer stays unrotated (``rotated`` False)."""

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> None:
        got = rotate_codes(codes, scales, mins) if self.bits == 8 else None
        if got is None:
            return super()._store(codes, scales, mins)
        self.rotated = True
        super()._store(*got)


# -- probing --------------------------------------------------------------------------------
@as_probe()
def probe() -> Verdict:
    """Whether ``csrc/qact.cpp`` builds, loads and agrees with a float reference
    here.  Returns (ok, reason); never raises."""
    load_library()
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 96, generator=gen)
    few_levels = woq.QuantizedLinear(weight, None, 4, woq.DEQUANT).dequantized()  # Q4_1's grid: rotates
    for bits, cls, w in ((4, BlockQ8Linear, weight), (8, BlockQ8Linear, weight), (4, TwoDigitLinear, weight),
                         (8, TwoDigitLinear, weight), (8, RotatedQ8Linear, few_levels)):
        layer = cls(w, None, bits, QACT)
        for rows in (1, 3, 5, 12):  # tiles of 4 rows and their remainders; 40 rows: 5 groups of 8
            x = torch.randn(rows, 96, generator=gen)
            check(layer(x), F.linear(x, layer.dequantized()), _PROBE_TOLERANCE[cls.digits],
                        f"{bits}-bit kernel ({cls.digits} activation digits) disagrees with the float reference")
    isa = torch.ops.ferrum_qact.isa()
    return True, built(isa + {"portable": "", "avx2": " vpmaddubsw"}.get(isa, " vpdpbusd"))


def choose_kernel(requested_linear: str) -> tuple[str, str]:
    """(kernel, reason); ``requested_linear == "aten"`` forces the torch fallback."""
    if requested_linear == "aten":
        return TORCH_Q8, "forced by configuration"
    ok, why = probe()
    return (QACT, why) if ok else (TORCH_Q8, f"fallback: {why}")


# Per mode: weight bits of the projections (the LM head is 8-bit in all), their layer
# type (activation digits, rotation) and the LM head's.
MODES = {"w8a8": (8, RotatedQ8Linear, TwoDigitLinear), "w4a8": (4, BlockQ8Linear, BlockQ8Linear),
         "int8": (8, TwoDigitLinear, TwoDigitLinear), "int4": (4, TwoDigitLinear, TwoDigitLinear)}


def quantize_model(model: nn.Module, mode: str, kernel: str, skip: tuple[str, ...] = ()) -> int:
    """Replaces every ``nn.Linear`` with a ``BlockQ8Linear`` (one activation digit:
    w4a8), ``RotatedQ8Linear`` (w8a8's projections; its LM head takes two digits) or
    ``TwoDigitLinear`` (int8, int4) of ``mode``'s width, in place (the LM head is
    8-bit in all); names ending with one of ``skip`` keep their weights.  Returns the
    bytes the quantized weights take."""
    bits, cls, head = MODES[mode]
    return woq.quantize_model(model, bits, kernel, skip, cls=cls, head_cls=head)


def rotation_note(model: nn.Module) -> str:
    """For the kernel path: how many of a w8a8 model's projections rotate their
    activations ("" where the model has none of that type)."""
    layers = [m for m in model.modules() if isinstance(m, RotatedQ8Linear)]
    if not layers:
        return ""
    return (f"activations rotated (rotate16) on {sum(m.rotated for m in layers)} of {len(layers)} projections, "
            f"LM head on two digits")
