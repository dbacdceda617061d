"""The float linear layers the decoder runs: ``FastLinear`` (oneDNN's prepacked
weights, or linear_rows.cpp's ``linear_rows`` for a few rows) and the fusing of several
projections into one GEMM."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


LINEAR_ROWS_MAX = 4  # csrc/fused.h kLinearRowsMax
# the rows linear_rows takes per weight dtype: it loads (and, bfloat16, widens) each weight
# row once per activation row, so past these oneDNN's packed GEMM is faster (bfloat16
# by 4 rows on SmolLM2-135M's shapes; float32 not yet at 4)
LINEAR_ROWS = {torch.float32: LINEAR_ROWS_MAX, torch.bfloat16: 2}


class FastLinear(nn.Module):
    """A linear layer that runs on oneDNN with a prepacked weight where that pays.

    Only built where ``kernels.probe_onednn_packed`` found the private ops
    working on this CPU and torch build.

    On CPU, bfloat16 GEMMs through oneDNN's packed path (AMX where present)
    beat ``F.linear`` at every batch size (docs/performance.md).  For float32
    the packed path always wins for M > 1 (MKL's small-M sgemm is slow), and
    for one row on some CPUs only (``kernels.packed_float32_wins_at_one_row``
    times it at load); the packed copy doubles float32 weight memory.  Where the
    fused ops run (``use_fused_ops``), float32 or bfloat16 forwards of up to
    ``LINEAR_ROWS[dtype]`` rows go to ``linear_rows`` instead, over the plain weight, which is then kept beside
    the packed one.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, pack: str):
        super().__init__()
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.pack = pack  # "always" | "batched" | "never"
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight) if pack != "never" else None
        # "always": only the packed copy is ever read, so the plain one is not kept
        # (a tied LM head's stays alive as the embedding); "batched" keeps both.
        self.weight = None if pack == "always" else nn.Parameter(weight, requires_grad=False)

    @property
    def nbytes(self) -> int:
        """Weight bytes one forward reads."""
        return self.in_features * self.out_features * (self.packed if self.packed is not None else self.weight
                                                       ).element_size()

    @classmethod
    def from_linear(cls, linear: nn.Linear, pack: str) -> FastLinear:
        return cls(linear.weight.data, None if linear.bias is None else linear.bias.data, pack)

    # set by LlamaForCausalLM.use_fused_ops: 1..LINEAR_ROWS[dtype] float32 or bfloat16 rows
    # run on linear_rows.cpp's linear_rows (a GEMV at memory speed) instead of oneDNN or MKL
    rows_kernel = False
    rows_max = 0
    # set by make_batch_invariant: the weight packed for csrc/panel_gemm.cpp's panel_linear,
    # which every row count runs (each output one chain over K, whatever the batch)
    panels: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None:
            y = torch.ops.ferrum_fused.panel_linear(x, self.panels, self.out_features)
            return y if self.bias is None else y + self.bias
        rows = x.numel() // x.shape[-1]
        if self.rows_kernel and rows <= self.rows_max and x.dtype == self.weight.dtype:
            y = torch.ops.ferrum_fused.linear_rows(x, self.weight)
            return y if self.bias is None else y + self.bias
        if self.packed is not None and (self.pack == "always" or rows > 1):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def fuse_linears(linears: list[nn.Linear]) -> nn.Linear:
    """One linear computing the concatenated outputs of several (one GEMM instead of many)."""
    first = linears[0]
    # skip_init: its random initialisation would be thrown away at once (and takes as
    # long as the concatenation)
    fused = torch.nn.utils.skip_init(nn.Linear, first.in_features, sum(l.out_features for l in linears),
                                     bias=first.bias is not None, device=first.weight.device,
                                     dtype=first.weight.dtype)
    fused.weight.data = torch.cat([l.weight.data for l in linears])
    if first.bias is not None:
        fused.bias.data = torch.cat([l.bias.data for l in linears])
    return fused


def replace_linears(root: nn.Module, pack: str) -> None:
    for name, child in list(root.named_children()):
        if isinstance(child, nn.Linear):
            setattr(root, name, FastLinear.from_linear(child, pack))
        else:
            replace_linears(child, pack)
