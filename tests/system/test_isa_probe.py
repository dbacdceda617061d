"""The llama.cpp anchor's fallback build keeps exactly the instruction sets whose test
programs run on this CPU (compiled with the set's flags, one of its instructions
executed on a full vector, as their disassembly shows), and names every option to cmake, AMX off."""

from __future__ import annotations

import importlib.util
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench import llama_cpp

pytestmark = pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64") or shutil.which("cc") is None,
                                reason="x86-64 with a C compiler only")

# /proc/cpuinfo's name for each option's instruction set
CPU_FLAG = {"GGML_SSE42": "sse4_2", "GGML_AVX": "avx", "GGML_AVX2": "avx2", "GGML_FMA": "fma", "GGML_F16C": "f16c",
            "GGML_BMI2": "bmi2", "GGML_AVX512": "avx512f", "GGML_AVX512_VBMI": "avx512vbmi",
            "GGML_AVX512_VNNI": "avx512_vnni", "GGML_AVX512_BF16": "avx512_bf16", "GGML_AVX_VNNI": "avx_vnni"}


# The instruction each set's test program must execute, as objdump writes it: one of the
# set's own on a full register of its width (xmm for SSE4.2, ymm for AVX, AVX2, FMA, F16C
# and AVX-VNNI, zmm for AVX-512), the dot product where the set is about one.  A program
# whose compiler scalarised or folded the body would run on a CPU without the set.
EXECUTES = {"GGML_SSE42": r"pcmpgtq\s.*%xmm", "GGML_AVX": r"vaddps\s.*%ymm", "GGML_AVX2": r"vpaddd\s.*%ymm",
            "GGML_FMA": r"vfmadd\d{3}ps\s.*%ymm", "GGML_F16C": r"vcvtph2ps\s.*%ymm", "GGML_BMI2": r"pdep\s",
            "GGML_AVX512": r"vaddps\s.*%zmm", "GGML_AVX512_VBMI": r"vpermb\s.*%zmm",
            "GGML_AVX512_VNNI": r"vpdpbusd\s.*%zmm", "GGML_AVX512_BF16": r"vdpbf16ps\s.*%zmm",
            "GGML_AVX_VNNI": r"vpdpbusd\s.*%ymm"}


def listed_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_a_program_that_faults_or_does_not_build_is_not_kept():
    assert llama_cpp.runs_here((), "out[0] = in[0];")
    assert not llama_cpp.runs_here((), "__builtin_trap();")  # SIGILL, as an instruction the CPU lacks
    assert not llama_cpp.runs_here(("-mno-such-instruction-set",), "out[0] = in[0];")
    assert not llama_cpp.runs_here((), "this is not C;")


def test_the_kept_sets_are_among_those_the_cpu_lists():
    """A set the CPU does not list cannot run; the listed ones may still fault (a VM),
    so only the first direction holds everywhere.  SSE4.2 runs on every x86-64-v2 CPU."""
    assert set(CPU_FLAG) == set(llama_cpp.ISA_OPTIONS)
    isa, flags = llama_cpp.probe_isa(), listed_flags()
    assert {CPU_FLAG[o] for o, ok in isa.items() if ok} <= flags, isa
    assert isa["GGML_SSE42"] == ("sse4_2" in flags)


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) reads the probe's disassembly")
@pytest.mark.parametrize("option", sorted(EXECUTES))
def test_each_probe_executes_its_set_on_a_full_vector(option, tmp_path):
    """The built program's main, straight-line code that always runs, holds the set's
    instruction on a full vector: a CPU without the set faults on it, whatever this CPU has."""
    flags, body = llama_cpp.ISA_OPTIONS[option]
    exe = tmp_path / "probe"
    if not llama_cpp.build_probe(flags, body, exe):
        pytest.skip(f"this compiler does not build {option}'s program ({' '.join(flags)})")
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(exe)], capture_output=True, text=True,
                             check=True, timeout=60).stdout
    main = listing.split("<main>:\n", 1)[1].split("\n\n", 1)[0]
    code = [(int(address, 16), text.strip()) for address, text in
            (line.split(":", 1) for line in main.splitlines() if ":" in line)]
    found = [address for address, text in code if re.search(EXECUTES[option], text)]
    assert found, f"{option}: no {EXECUTES[option]!r} in main:\n{main}"
    # Nothing before it in main leaves main or jumps past it: the program executes it.
    for address, text in code:
        if address >= found[0]:
            break
        assert not text.startswith("ret"), f"{option}: main returns before {found[0]:x}:\n{main}"
        if (jump := re.match(r"j[a-z]+\s+([0-9a-f]+) <", text)) is not None:
            assert int(jump[1], 16) <= found[0], f"{option}: a jump past {found[0]:x}:\n{main}"


def test_the_portable_build_names_every_option():
    isa = {o: o in ("GGML_AVX2", "GGML_AVX512_VNNI") for o in llama_cpp.ISA_OPTIONS}
    args = llama_cpp.portable_cmake_args(isa)
    assert args[0] == "-DGGML_NATIVE=OFF"
    assert {a for a in args if a.endswith("=ON")} == {"-DGGML_AVX2=ON", "-DGGML_AVX512_VNNI=ON"}
    named = {a.removeprefix("-D").split("=")[0] for a in args}
    assert named == {"GGML_NATIVE", *llama_cpp.ISA_OPTIONS, "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}
    assert len(args) == len(named)


def test_the_avx2_cap_picks_its_own_anchor(monkeypatch, tmp_path):
    """Under FERRUM_RPC_MAX_ISA=avx2 the anchor lives apart and is built with no set an
    AVX2-only CPU lacks, whatever this CPU runs."""
    monkeypatch.setenv("FERRUM_RPC_HOME", str(tmp_path))
    monkeypatch.delenv("FERRUM_RPC_MAX_ISA", raising=False)
    assert llama_cpp.venv_dir() == tmp_path / "llama-cpp-venv"
    monkeypatch.setenv("FERRUM_RPC_MAX_ISA", "avx2")
    assert llama_cpp.venv_dir() == tmp_path / "llama-cpp-venv-avx2"
    everything = {o: True for o in llama_cpp.ISA_OPTIONS}
    args = llama_cpp.portable_cmake_args({o: ok for o, ok in everything.items() if o in llama_cpp.AVX2_ERA})
    assert {a for a in args if a.endswith("=ON")} == {f"-D{o}=ON" for o in llama_cpp.AVX2_ERA}
    assert "-DGGML_AVX512=OFF" in args and "-DGGML_AVX_VNNI=OFF" in args


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp importable here")
def test_a_first_forward_that_fails_says_why():
    """The probe in an environment without llama-cpp-python: reported, not raised."""
    why = llama_cpp.first_forward(Path(sys.executable), Path("/nonexistent.gguf"))
    assert why is not None and why.startswith("exit status 1: ModuleNotFoundError"), why
