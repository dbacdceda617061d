"""The llama.cpp anchor's fallback build keeps exactly the instruction sets whose test
programs run on this CPU (compiled with the set's flags, one of its instructions
executed), and names every option to cmake, AMX off."""

from __future__ import annotations

import importlib.util
import platform
import shutil
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


def listed_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def test_a_program_that_faults_or_does_not_build_is_not_kept():
    assert llama_cpp.runs_here((), "sink += 1;")
    assert not llama_cpp.runs_here((), "__builtin_trap();")  # SIGILL, as an instruction the CPU lacks
    assert not llama_cpp.runs_here(("-mno-such-instruction-set",), "sink += 1;")
    assert not llama_cpp.runs_here((), "this is not C;")


def test_the_kept_sets_are_among_those_the_cpu_lists():
    """A set the CPU does not list cannot run; the listed ones may still fault (a VM),
    so only the first direction holds everywhere.  SSE4.2 runs on every x86-64-v2 CPU."""
    assert set(CPU_FLAG) == set(llama_cpp.ISA_OPTIONS)
    isa, flags = llama_cpp.probe_isa(), listed_flags()
    assert {CPU_FLAG[o] for o, ok in isa.items() if ok} <= flags, isa
    assert isa["GGML_SSE42"] == ("sse4_2" in flags)


def test_the_portable_build_names_every_option():
    isa = {o: o in ("GGML_AVX2", "GGML_AVX512_VNNI") for o in llama_cpp.ISA_OPTIONS}
    args = llama_cpp.portable_cmake_args(isa)
    assert args[0] == "-DGGML_NATIVE=OFF"
    assert {a for a in args if a.endswith("=ON")} == {"-DGGML_AVX2=ON", "-DGGML_AVX512_VNNI=ON"}
    named = {a.removeprefix("-D").split("=")[0] for a in args}
    assert named == {"GGML_NATIVE", *llama_cpp.ISA_OPTIONS, "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"}
    assert len(args) == len(named)


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama_cpp importable here")
def test_a_first_forward_that_fails_says_why():
    """The probe in an environment without llama-cpp-python: reported, not raised."""
    why = llama_cpp.first_forward(Path(sys.executable), Path("/nonexistent.gguf"))
    assert why is not None and why.startswith("exit status 1: ModuleNotFoundError"), why
