"""Probing a kernel: run it for real on small inputs and compare it with the eager
torch reference, once per process.

A fast path is taken only where it runs and agrees here: a private torch op
may be missing from a build or raise on a CPU without the instructions it
needs, and our C++ may fail to build.  Every probe (``select.probe_onednn_packed``,
``woq.probe_woq``, ``fused.probe_fused``, ``qact.probe``) is a function returning
``(ok, reason)`` wrapped by ``as_probe``: it never raises (a failure of any kind
is a "no" with a reason, and the fallback serves), and its answer is kept for
the process.  Agreement is the largest absolute difference over the
reference's largest magnitude (at least 1), within a tolerance for the dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

Verdict = tuple[bool, str]  # (ok, reason)

# Relative error accepted against the reference: float32 kernels sum in another
# order than torch, bfloat16 ones round their outputs (2^-8 relative) too.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class Disagrees(Exception):
    """A kernel's output is further from the reference than the tolerance: the probe's "no"."""


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(max |want|, 1), in float32."""
    got, want = got.float(), want.float()
    return (got - want).abs().max().item() / max(want.abs().max().item(), 1.0)


def within(err: float, tolerance: float, what: str) -> None:
    """Raises ``Disagrees("<what> (relative error <err>)")`` unless ``err <= tolerance`` (NaN is not)."""
    if not err <= tolerance:
        raise Disagrees(f"{what} (relative error {err:.2e})")


def check(got: torch.Tensor, want: torch.Tensor, tolerance: float, what: str) -> None:
    """``within`` for the relative error of ``got`` against ``want``."""
    within(relative_error(got, want), tolerance, what)


def built(isa: str) -> str:
    """The reason a probe of our C++ kernels gives when they built and agreed."""
    return f"built and probed OK ({isa} inner loops)"


def as_probe(failed: str = "", limit: int = 300) -> Callable[[Callable[..., Verdict]], Callable[..., Verdict]]:
    """Makes ``fn(*args) -> (ok, reason)`` a probe: its answer kept per ``args`` for the
    process, ``Disagrees`` a "no" with its message, and any other exception a "no"
    with reason ``failed`` + the exception's type and its message's first ``limit``
    characters."""

    def wrap(fn: Callable[..., Verdict]) -> Callable[..., Verdict]:
        @functools.lru_cache(maxsize=None)
        @functools.wraps(fn)
        def run(*args) -> Verdict:
            try:
                return fn(*args)
            except Disagrees as no:
                return False, str(no)
            except Exception as exc:  # a failed build, load or call means "not here"
                return False, f"{failed}{type(exc).__name__}: {str(exc)[:limit]}"

        return run

    return wrap
