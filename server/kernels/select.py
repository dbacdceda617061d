"""Which kernel path each model gets, chosen by probing once at load; and the one
place in Python that asks what the CPU is (``cpu_capability``, ``cpu_identity``,
oneDNN's bfloat16 check): other modules ask here.  The C++ kernels ask
``csrc/cpu_features.cpp`` (tests/component/kernels/test_cpu_probe.py keeps both so).

A fast path is only taken where the running CPU and torch build can run it:
the oneDNN prepacked linear is a private torch op whose bfloat16 kernels
need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT, and on an AVX2-only CPU it raises
at load.  So every private op is probed here (``probe.py``), by a real call
checked against ``F.linear``, and anything that fails or disagrees falls back
to plain ``F.linear`` (always correct, on every CPU).  ``linear_kernel="aten"``
forces the fallback, so the test suite runs both paths on every machine.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

from ferrum_rpc.paths import cache_root
from .probe import TOLERANCE, Verdict, as_probe, check
from ..config import LINEAR_KERNELS

AUTO, ONEDNN_PACKED, ATEN = LINEAR_KERNELS
# oneDNN's bfloat16 linear against F.linear in float32: wider than probe.TOLERANCE's 2e-2.
_PROBE_TOLERANCE = {torch.float32: TOLERANCE[torch.float32], torch.bfloat16: 3e-2}


@dataclass(frozen=True)
class KernelChoice:
    """The linear kernel a model runs and why it was chosen.

    Attributes:
        linear: ``"onednn-packed"`` or ``"aten"``.
        reason: why (the probe's finding, or "forced by configuration").
        cpu_capability: ATen's view of the CPU ("AVX512", "AVX2", "DEFAULT"...).
    """

    linear: str
    reason: str
    cpu_capability: str
    step: str = "eager"  # fused step ops or not, and why (see fused.py)

    def describe(self) -> str:
        return f"linear={self.linear} ({self.reason}); step={self.step}"


def cpu_capability() -> str:
    """The vector ISA ATen dispatches to on this CPU, as torch reports it."""
    getter = getattr(torch.backends.cpu, "get_cpu_capability", None)
    return getter() if getter else "unknown"


def onednn_bf16_supported() -> bool:
    """Whether oneDNN runs bfloat16 on this CPU (AVX-512 BW/VL/DQ or AVX-NE-CONVERT), as
    torch reports it; True where this torch build cannot say (the probe then decides)."""
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return supported is None or bool(supported())


def choose_linear(requested: str, dtype: torch.dtype, device: torch.device) -> KernelChoice:
    """Picks the linear kernel for weights of ``dtype`` on ``device``.

    Args:
        requested: "auto" (probe), "onednn-packed" (probe, and fail if it cannot
            run here), or "aten" (the fallback, always).
    Raises:
        ValueError: for an unknown ``requested``, or a forced path that cannot run here.
    """
    if requested not in LINEAR_KERNELS:
        raise ValueError(f"linear kernel must be one of {LINEAR_KERNELS}, not {requested!r}")
    capability = cpu_capability() if device.type == "cpu" else device.type
    if requested == ATEN:
        return KernelChoice(ATEN, "forced by configuration", capability)
    if device.type != "cpu":
        ok, why = False, f"oneDNN packing is a CPU path; device is {device.type}"
    else:
        ok, why = probe_onednn_packed(dtype)
    if ok:
        return KernelChoice(ONEDNN_PACKED, why, capability)
    if requested == ONEDNN_PACKED:
        raise ValueError(f"linear kernel {ONEDNN_PACKED!r} cannot run here: {why}")
    return KernelChoice(ATEN, f"fallback: {why}", capability)


@as_probe(failed="oneDNN packed linear failed: ", limit=200)
def probe_onednn_packed(dtype: torch.dtype) -> Verdict:
    """Whether oneDNN's prepacked linear runs, and agrees with ``F.linear``, for ``dtype``.

    Returns (ok, reason).  Never raises: a probe that fails is a "no".
    """
    if dtype not in _PROBE_TOLERANCE:
        return False, f"no packed path for {dtype}"
    if not torch.backends.mkldnn.is_available():
        return False, "torch was built without oneDNN"
    ops = torch.ops.mkldnn
    for name in ("_reorder_linear_weight", "_linear_pointwise"):
        if not hasattr(ops, name):
            return False, f"torch.ops.mkldnn.{name} is missing from this torch build"
    if dtype == torch.bfloat16 and not onednn_bf16_supported():
        return False, "this CPU lacks oneDNN's bfloat16 support (needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT)"
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen).to(dtype)
    bias = torch.randn(48, generator=gen).to(dtype)
    packed = ops._reorder_linear_weight(weight)
    for rows in (1, 5):
        x = torch.randn(rows, 64, generator=gen).to(dtype)
        check(ops._linear_pointwise(x, packed, bias, "none", [], ""), F.linear(x.float(), weight.float(), bias.float()),
              _PROBE_TOLERANCE[dtype], "oneDNN packed linear disagrees with F.linear")
    return True, f"oneDNN packed linear probed OK for {str(dtype).removeprefix('torch.')}"


@functools.lru_cache(maxsize=None)
def packed_float32_wins_at_one_row() -> tuple[bool, str]:
    """Whether the oneDNN packed float32 linear beats ``F.linear`` (MKL) for one
    activation row on this CPU, timed on a weight larger than the L2 cache.

    It wins on some CPUs and loses on others (docs/performance.md has the figures),
    so it is timed, not assumed.
    The answer is kept on disk per CPU model, torch version and thread count
    (``$FERRUM_RPC_HOME/kernels``) and reused: servers of one configuration on one
    host must compute the same bits (a sequence moved between them decodes
    bit-identically), and two servers timing at once, each slowed by the other,
    once chose differently.  Delete the file to time again.
    Call only where ``probe_onednn_packed(torch.float32)`` said yes.
    """
    key = hashlib.sha256(f"{_cpu_model()}|{torch.__version__}|{torch.get_num_threads()}".encode()).hexdigest()[:16]
    path = cache_root() / "kernels" / f"float32-one-row-{key}.json"
    def saved() -> tuple[bool, str] | None:
        try:
            got = json.loads(path.read_text())
            return bool(got["wins"]), f"{got['timing']} (timed once on this host: {path.name})"
        except (OSError, ValueError, KeyError):
            return None

    if (known := saved()) is not None:
        return known
    wins, timing = _time_packed_float32_one_row()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(dir=path.parent, suffix=".json")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"wins": wins, "timing": timing}, f)
            os.link(staging, path)  # atomic, and refused if it exists: the first to time it decides
        except FileExistsError:
            pass
        finally:
            os.unlink(staging)
    except OSError as exc:
        log.warning("could not keep the float32 one-row timing in %s: %s", path.parent, exc)
        return wins, timing
    return saved() or (wins, timing)


def _cpuinfo() -> dict[str, tuple[int, str]] | None:
    """Each key of Linux's /proc/cpuinfo with its first line (as read) and that
    line's index; None where there is no such file."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines(keepends=True)
    except OSError:
        return None
    first: dict[str, tuple[int, str]] = {}
    for i, line in enumerate(lines):
        first.setdefault(line.partition(":")[0].strip(), (i, line))
    return first


def _cpu_model() -> str:
    """The first "model name" or "flags" line, whichever comes first, else what platform says."""
    first = _cpuinfo() or {}
    found = [first[key] for key in ("model name", "flags") if key in first]
    return min(found)[1] if found else platform.processor() or platform.machine()


def cpu_identity() -> str:
    """The CPU's model name and feature flags as JSON (/proc/cpuinfo's "model name" and
    "flags", or "Features" and "CPU part" on ARM; flags sorted), else what platform
    says: a key for what is measured once per CPU."""
    first = _cpuinfo()
    if first is None:
        return f"{platform.machine()} {platform.processor()}"
    seen = {}
    for key in ("model name", "flags", "Features", "CPU part"):
        if key in first:
            value = first[key][1].partition(":")[2]
            seen[key] = " ".join(sorted(value.split())) if key in ("flags", "Features") else value.strip()
    return json.dumps(seen, sort_keys=True)


def _time_packed_float32_one_row() -> tuple[bool, str]:
    weight = torch.randn(4096, 1024, generator=torch.Generator().manual_seed(0))
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    x = torch.randn(1, 1024)

    def best(fn) -> float:
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times[2:])

    plain = best(lambda: F.linear(x, weight))
    onednn = best(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
    return onednn < 0.9 * plain, f"one row: oneDNN packed {onednn * 1e6:.0f} us, F.linear {plain * 1e6:.0f} us"
