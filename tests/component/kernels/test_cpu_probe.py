"""What the CPU can run is asked in one place a language: csrc/cpu_features.cpp for
the C++ kernels, server/kernels/select.py for Python; every other source asks them.
And the kernels' choice of inner loops follows what that one C++ probe found."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ferrum_rpc.server.kernels import select, woq

ROOT = Path(__file__).resolve().parents[3]
# The hand-written sources: the server, the Python client and core, the C++ and Rust clients.
SCANNED = ("server", "client", "ferrum_rpc", "clients")
SUFFIXES = {".py", ".cpp", ".cc", ".h", ".hpp", ".inc", ".rs"}
SKIPPED_DIRS = {"target", "build", "node_modules", "__pycache__", ".venv"}
# Ways of asking the CPU (or the OS about it) what it has.
PROBE = re.compile(r"__builtin_cpu_(supports|init|is)|cpuid(?!le)|xgetbv|getauxval|AT_HWCAP"
                   r"|/proc/cpuinfo|\blscpu\b|get_cpu_capability|_is_mkldnn_bf16_supported|is_x86_feature_detected")
ALLOWED = {"server/kernels/csrc/cpu_features.cpp", "server/kernels/select.py"}
# Files that still probe on their own, outside this change's reach; each should ask
# select.py instead (crossover.py: select.cpu_identity() gives its _cpu_identity()'s
# string).  A file that no longer probes must leave this list (the test says so).
NOT_YET: set[str] = set()


def _sources():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*")):
            rel = path.relative_to(ROOT)
            if path.suffix in SUFFIXES and path.is_file() and not SKIPPED_DIRS & set(rel.parts) \
                    and not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield rel.as_posix(), path.read_text(errors="replace")


def test_the_cpu_is_probed_only_in_cpu_features_cpp_and_select_py():
    probing = {rel for rel, text in _sources() if PROBE.search(text)}
    assert ALLOWED <= probing, f"the probe modules should probe: {sorted(ALLOWED - probing)}"
    stray = probing - ALLOWED - NOT_YET
    assert not stray, f"CPU probes outside cpu_features.cpp / select.py: {sorted(stray)}"
    done = NOT_YET - probing
    assert not done, f"{sorted(done)} no longer probe: take them off NOT_YET"


def test_the_scan_finds_a_probe_where_one_is_written(tmp_path):
    """The pattern matches each way of asking, so the scan above can fail."""
    for line in ('__builtin_cpu_supports("avx2")', "__get_cpuid(7, &a, &b, &c, &d)", "_xgetbv(0)",
                 'open("/proc/cpuinfo")', "torch.backends.cpu.get_cpu_capability()",
                 "getauxval(AT_HWCAP)", 'is_x86_feature_detected!("avx2")'):
        assert PROBE.search(line), line
    assert not PROBE.search("ferrum_cpu::cpu_features().avx512vl && ferrum_active_isa() >= 2")


def _flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        pytest.skip("no /proc/cpuinfo to compare with")
    line = next((l for l in text.splitlines() if l.startswith("flags")), None)
    if line is None:
        pytest.skip("/proc/cpuinfo lists no x86 flags")
    return set(line.partition(":")[2].split())


@pytest.fixture
def ops():
    ok, why = woq.probe_woq()
    assert ok, why
    yield torch.ops
    torch.ops.ferrum_woq.set_max_isa("avx512")
    torch.ops.ferrum_qact.set_max_isa("avx512-vnni")


def test_each_kernel_family_runs_the_widest_loops_the_cpu_lists(ops):
    """woq, qact and the bfloat16 dot product (panel_gemm) all read cpu_features():
    uncapped, each runs what Linux's flags (already cleared where the OS does not
    save the registers) say this CPU has."""
    f = _flags()
    avx2 = {"avx2", "fma"} <= f
    avx512 = avx2 and "avx512f" in f
    assert ops.ferrum_woq.isa() == ("avx512" if avx512 else "avx2" if avx2 else "portable")
    # qact: its own levels under woq's cap (AVX-VNNI without AVX-512 runs; each level needs F16C)
    qavx2 = avx2 and "f16c" in f
    if avx512 and qavx2 and {"avx512_vnni", "avx512vl", "avx512bw"} <= f:
        want = "avx512-vnni"
    elif qavx2 and "avx_vnni" in f:
        want = "avx-vnni"
    else:
        want = "avx2" if qavx2 else "portable"
    assert ops.ferrum_qact.isa() == want
    assert ops.ferrum_fused.panel_dot_runs() == ({"avx512_bf16", "avx512f"} <= f)
    # the cap takes every family down with it
    assert ops.ferrum_woq.set_max_isa("portable") == "portable"
    assert ops.ferrum_qact.isa() == "portable" and not ops.ferrum_fused.panel_dot_runs()


def test_cpu_identity_names_the_model_and_sorted_flags():
    _flags()  # skips off Linux x86
    got = json.loads(select.cpu_identity())
    flags = got.get("flags") or got.get("Features")
    assert flags is not None and flags.split() == sorted(flags.split())


@pytest.mark.parametrize("cap,want", [("avx2", ("avx2", "avx2")), ("avx-vnni", ("avx2", "avx-vnni")),
                                      ("portable", ("portable", "portable"))])
def test_the_isa_cap_stands_for_a_cpu_without_what_it_leaves_out(cap, want):
    """FERRUM_RPC_MAX_ISA caps the float and the integer loops alike: ``avx2`` is an AVX2
    CPU without AVX-VNNI, so no vpdpbusd either (the proxy for an AVX2-only host);
    ``avx-vnni`` keeps it.  In a child: the cap is read once, at load."""
    f = _flags()
    if want[1] == "avx-vnni" and not {"avx_vnni", "avx2", "fma", "f16c"} <= f:
        pytest.skip("this CPU has no AVX-VNNI")
    if want[0] == "avx2" and not {"avx2", "fma", "f16c"} <= f:
        pytest.skip("this CPU has no AVX2")
    script = ("import torch; from ferrum_rpc.server.kernels.build import load_library; load_library(); "
              "print(torch.ops.ferrum_woq.isa(), torch.ops.ferrum_qact.isa())")
    done = subprocess.run([sys.executable, "-c", script], env=dict(os.environ, FERRUM_RPC_MAX_ISA=cap),
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert tuple(done.stdout.split()) == want
