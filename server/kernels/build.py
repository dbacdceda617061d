"""Building the CPU kernels: every ``csrc/*.cpp`` compiled with the system C++
compiler into one shared library, loaded into the process once.

The library holds the ``ferrum_woq`` (woq.cpp), ``ferrum_qact`` (qact.cpp) and
``ferrum_fused`` (rms_norm.cpp, silu_mul.cpp, attention.cpp, linear_rows.cpp,
decode_stack.cpp, stack_regions.cpp, lora.cpp) ops.  It is built the first time a probe or a caller needs
it and cached under ``$FERRUM_RPC_HOME/kernels``, keyed by every file in
``csrc/`` (sources and the headers they include), the flags, the torch version
and the compiler, so any edit or upgrade builds afresh.  The sources compile
one process each, side by side, then link.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ferrum_rpc.paths import cache_root

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
# -fopenmp: at::parallel_for is inline OpenMP; without it every kernel ran on one thread.
_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-std=c++20")


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def sources() -> list[Path]:
    """The translation units: every ``.cpp`` in ``csrc/``."""
    return sorted(CSRC.glob("*.cpp"))


def _key() -> str:
    """A hash of every file in ``csrc/`` (name and bytes), the flags, torch and the compiler."""
    digest = hashlib.sha256()
    for path in sorted(p for p in CSRC.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    version = subprocess.run([_compiler(), "--version"], capture_output=True, text=True, check=True).stdout
    digest.update(" ".join(_FLAGS).encode() + torch.__version__.encode() + version.encode() + sys.platform.encode())
    return digest.hexdigest()[:16]


def _run(cmd: list[str]) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{_compiler()} failed: {done.stderr[-800:]}")


def _compile(work: Path, target: Path) -> None:
    """Every source to an object in ``work``, side by side, then linked into ``target``."""
    from torch.utils import cpp_extension

    libs = cpp_extension.library_paths()
    defines = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    units = {src: work / f"{src.stem}.o" for src in sources()}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        list(pool.map(lambda src: _run([_compiler(), *_FLAGS, *defines, *includes, "-c", str(src),
                                        "-o", str(units[src])]), units))
    _run([_compiler(), "-shared", "-fopenmp", *map(str, units.values()), *[f"-L{p}" for p in libs], "-lc10",
          "-ltorch_cpu", *[f"-Wl,-rpath,{p}" for p in libs], "-o", str(target)])


def build_extension() -> Path:
    """Compiles ``csrc/*.cpp`` into one library, once (cached on disk), and returns it.

    Raises:
        RuntimeError: the compiler failed (its last lines of output in the message).
    """
    target = _cache_dir() / f"cpu-kernels-{_key()}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernels (int8/int4 linears, fused step ops; once per torch version and "
             "compiler, ~30 s): %s", target.name)
    start = time.perf_counter()
    work = Path(tempfile.mkdtemp(dir=target.parent))
    try:
        _compile(work, work / target.name)
        os.replace(work / target.name, target)  # atomic: a concurrent build never sees half a file
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("compiled %s in %.1fs", target.name, time.perf_counter() - start)
    return target


@functools.lru_cache(maxsize=None)
def load_library() -> None:
    """Builds (once, cached on disk) and loads the CPU kernels into this process.
    Raises where they cannot be built or loaded.  ``FERRUM_RPC_MAX_ISA`` caps their
    inner loops, as a weaker CPU would (``_CAPS``)."""
    torch.ops.load_library(str(build_extension()))
    if cap := os.environ.get("FERRUM_RPC_MAX_ISA"):
        fused, integer = _CAPS.get(cap, (cap, cap))
        log.info("CPU kernels capped at %s inner loops: now %s, integer loops %s", cap,
                 torch.ops.ferrum_woq.set_max_isa(fused), torch.ops.ferrum_qact.set_max_isa(integer))


# FERRUM_RPC_MAX_ISA: the cap of the float loops (woq.cpp's, which every fused op
# follows) and of the integer loops (qact.cpp's) it stands for.  ``avx2`` is an AVX2
# CPU without AVX-VNNI (Haswell to Skylake, Zen 2 and 3), so no vpdpbusd either;
# ``avx-vnni`` one with it (Alder Lake, Zen 5 without AVX-512).
_CAPS = {"avx512": ("avx512", "avx512-vnni"), "avx-vnni": ("avx2", "avx-vnni"), "avx2": ("avx2", "avx2"),
         "portable": ("portable", "portable")}
