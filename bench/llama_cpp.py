"""llama.cpp on the same GGUF file, the anchor for bench.decode_throughput (batch 1, 8, 32).

llama-cpp-python compiles llama.cpp for several minutes, so it lives in its own
cached environment, built once:

    python -m bench.llama_cpp --setup        # creates $FERRUM_RPC_HOME/llama-cpp-venv
    <that venv>/bin/python -m bench.llama_cpp --run --batch 8 ...   # what decode_throughput calls

``--setup`` builds llama.cpp for the CPU it runs on (GGML_NATIVE=ON), then runs the
built library's first forward on the GGUF in a child process.  A CPU may list an
instruction set it faults on (a VM that shows AMX but traps its tile instructions:
the native build dies in ``ldtilecfg``), so if that child crashes, llama.cpp is built
again with GGML_NATIVE=OFF and each instruction-set option set explicitly: ON for the
sets whose test program (compiled with that set's flags, one of its instructions
executed on a full vector) runs here, OFF for the rest and for AMX; ``--portable`` builds so at once.
Under ``FERRUM_RPC_MAX_ISA=avx2`` (the cap our kernels take, see server/kernels/build.py)
the anchor is another environment, ``llama-cpp-venv-avx2``, built that way with the
AVX2-era sets alone: a ratio taken under the cap runs, on both sides, what an AVX2-only
CPU would (on a newer CPU a proxy: its cores and memory are not that CPU's).
Once a build's first forward runs, ``anchor.json`` in the environment records it;
:func:`require` (the benchmarks that compare against llama.cpp) exits non-zero with
one line when there is none.

``--run`` prints one JSON record per line (greedy, the same prompts as ours);
``--argmax --ids '[...]'`` prints the next-token argmax at every position of
those token ids (teacher-forced, for bench.quant_accuracy).
It needs nothing from ferrum_rpc, so it runs in that environment alone.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

VERSION = "0.3.36"


def capped() -> bool:
    """Whether ``FERRUM_RPC_MAX_ISA=avx2`` caps this run, as it caps our kernels: the
    anchor is then llama.cpp built with the AVX2-era sets alone (:data:`AVX2_ERA`), so
    both sides of a ratio run the code an AVX2-only CPU would."""
    return os.environ.get("FERRUM_RPC_MAX_ISA", "").lower() == "avx2"


def venv_dir() -> Path:
    home = Path(os.environ.get("FERRUM_RPC_HOME", Path.home() / ".cache" / "ferrum-rpc"))
    return home / ("llama-cpp-venv-avx2" if capped() else "llama-cpp-venv")


def python() -> Path | None:
    exe = venv_dir() / "bin" / "python"
    return exe if exe.exists() else None


MARKER = "anchor.json"  # in the environment: which build passed its first-forward probe
PROBE_TIMEOUT_S = 600
# llama.cpp's x86 instruction-set options (ggml/CMakeLists.txt): the compiler flags that
# enable the set, and a C body executing one of the set's instructions on a full vector
# (the dot product where the set is about one).  The body reads its vectors from ``in``
# and writes every lane to ``out`` (128 bytes each, see ``PROBE_PROGRAM``): the inputs are
# unknown until the program runs and every output lane is used, so the compiler can
# neither fold the instruction away nor narrow it to one lane of an older set.
ISA_OPTIONS: dict[str, tuple[tuple[str, ...], str]] = {
    "GGML_SSE42": (("-msse4.2",), "_mm_storeu_si128((__m128i *)out, _mm_cmpgt_epi64("
                   "_mm_loadu_si128((const __m128i *)in), _mm_loadu_si128((const __m128i *)(in + 16))));"),
    "GGML_AVX": (("-mavx",), "__m256 a = _mm256_loadu_ps((const float *)in); "
                 "_mm256_storeu_ps((float *)out, _mm256_add_ps(a, _mm256_loadu_ps((const float *)(in + 32))));"),
    "GGML_AVX2": (("-mavx2",), "__m256i a = _mm256_loadu_si256((const __m256i *)in); "
                  "_mm256_storeu_si256((__m256i *)out, "
                  "_mm256_add_epi32(a, _mm256_loadu_si256((const __m256i *)(in + 32))));"),
    "GGML_FMA": (("-mavx", "-mfma"), "__m256 a = _mm256_loadu_ps((const float *)in); "
                 "_mm256_storeu_ps((float *)out, _mm256_fmadd_ps(a, _mm256_loadu_ps((const float *)(in + 32)), a));"),
    "GGML_F16C": (("-mf16c",), "_mm256_storeu_ps((float *)out, "
                  "_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)in)));"),
    "GGML_BMI2": (("-mbmi2",), "unsigned x, mask; memcpy(&x, in, 4); memcpy(&mask, in + 4, 4); "
                  "x = _pdep_u32(x, mask); memcpy(out, &x, 4);"),
    "GGML_AVX512": (("-mavx512f",), "__m512 a = _mm512_loadu_ps(in); "
                    "_mm512_storeu_ps(out, _mm512_add_ps(a, _mm512_loadu_ps(in + 64)));"),
    "GGML_AVX512_VBMI": (("-mavx512f", "-mavx512vbmi"), "__m512i a = _mm512_loadu_si512(in); "
                         "_mm512_storeu_si512(out, _mm512_permutexvar_epi8(a, a));"),
    "GGML_AVX512_VNNI": (("-mavx512f", "-mavx512vnni"), "__m512i a = _mm512_loadu_si512(in); "
                         "_mm512_storeu_si512(out, _mm512_dpbusd_epi32(a, a, a));"),
    "GGML_AVX512_BF16": (("-mavx512f", "-mavx512bf16"), "__m512 a = _mm512_loadu_ps(in); "
                         "__m512bh b = _mm512_cvtne2ps_pbh(a, a); _mm512_storeu_ps(out, _mm512_dpbf16_ps(a, b, b));"),
    "GGML_AVX_VNNI": (("-mavx2", "-mavxvnni"), "__m256i a = _mm256_loadu_si256((const __m256i *)in); "
                      "_mm256_storeu_si256((__m256i *)out, _mm256_dpbusd_avx_epi32(a, a, a));"),
}
# Never on in the portable build: the tile instructions are what a VM may list and fault on.
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# What an AVX2-only CPU (AVX2 and FMA, no AVX-512, no AVX-VNNI) runs: the capped build's sets.
AVX2_ERA = ("GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")


# The program around a body: ``in`` holds bytes read through a volatile pointer (and
# offset by argc), ``out`` is folded into the printed checksum byte by byte.
PROBE_PROGRAM = """#include <immintrin.h>
#include <stdio.h>
#include <string.h>
static volatile unsigned char seed[128];
int main(int argc, char **argv) {
    unsigned char in[128] __attribute__((aligned(64))), out[128] __attribute__((aligned(64)));
    unsigned checksum = 0;
    (void)argv;
    memset(out, 0, sizeof out);
    for (int i = 0; i < 128; i++) in[i] = (unsigned char)(seed[i] + argc + i);
    BODY
    for (int i = 0; i < 128; i++) checksum = checksum * 31u + out[i];
    printf("ran %u\\n", checksum);
    return 0;
}
"""


def build_probe(flags: Sequence[str], body: str, exe: Path, compiler: str = "cc") -> bool:
    """Compiles the test program executing ``body`` with ``flags`` into ``exe``; False when
    the compiler refuses the flags or the body."""
    try:
        built = subprocess.run([compiler, "-O1", *flags, "-x", "c", "-", "-o", str(exe)],
                               input=PROBE_PROGRAM.replace("BODY", body), capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return False
    return built.returncode == 0


def runs_here(flags: Sequence[str], body: str, compiler: str = "cc") -> bool:
    """Whether a C program compiled with ``flags`` and executing ``body`` runs to its end
    on this CPU (False when the compiler refuses the flags or the program faults)."""
    with tempfile.TemporaryDirectory(prefix="ferrum-isa-") as folder:
        exe = Path(folder) / "probe"
        if not build_probe(flags, body, exe, compiler):
            return False
        try:
            ran = subprocess.run([str(exe)], capture_output=True, text=True, timeout=30)
        except subprocess.TimeoutExpired:
            return False
        return ran.returncode == 0 and ran.stdout.startswith("ran ")


def probe_isa(compiler: str = "cc") -> dict[str, bool]:
    """Each of llama.cpp's instruction-set options: whether its test program runs here
    (compiled and run side by side, one per CPU)."""
    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        kept = pool.map(lambda item: runs_here(item[0], item[1], compiler), ISA_OPTIONS.values())
        return dict(zip(ISA_OPTIONS, kept))


def portable_cmake_args(isa: dict[str, bool]) -> list[str]:
    """llama.cpp's cmake arguments for a build with exactly the sets ``isa`` keeps: every
    option named (with GGML_NATIVE off the unnamed ones would default to ON)."""
    return ["-DGGML_NATIVE=OFF", *(f"-D{o}={'ON' if isa.get(o) else 'OFF'}" for o in ISA_OPTIONS),
            *(f"-D{o}=OFF" for o in ALWAYS_OFF)]


def install(target: Path, cmake_args: Sequence[str]) -> None:
    """pip-installs llama-cpp-python into ``target``, compiled with ``cmake_args`` (none:
    its default, GGML_NATIVE=ON), replacing any build installed there (alone: its
    dependencies stay).  A build with arguments skips pip's wheel cache, which may hold
    a native wheel under the same name and version (only native ones are cached)."""
    pip = str(target / "bin" / "pip")
    env, again = dict(os.environ), []
    if subprocess.run([pip, "show", "-q", "llama-cpp-python"], capture_output=True).returncode == 0:
        again += ["--force-reinstall", "--no-deps"]
    if cmake_args:
        env["CMAKE_ARGS"] = " ".join(cmake_args)
        again.append("--no-cache-dir")
    subprocess.run([pip, "install", *again, f"llama-cpp-python=={VERSION}"], env=env, check=True)


def first_forward(exe: Path, gguf: Path) -> str | None:
    """Runs the built library's first forward (``--probe``) in a child process: None when
    it runs, else what went wrong (the signal that killed it, or its last line)."""
    root = Path(__file__).resolve().parent.parent
    try:
        done = subprocess.run([str(exe), "-m", "bench.llama_cpp", "--probe", "--gguf", str(gguf)],
                              capture_output=True, text=True, cwd=root, timeout=PROBE_TIMEOUT_S,
                              env={**os.environ, "PYTHONPATH": str(root)})
    except subprocess.TimeoutExpired:
        return f"no answer in {PROBE_TIMEOUT_S} s"
    if done.returncode == 0 and done.stdout.strip().endswith("ok"):
        return None
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
    return f"exit status {done.returncode}: {last}"


def setup(gguf: Path, portable: bool = False) -> None:
    """Builds the environment (native first unless ``portable``), probes its first forward,
    falls back to the portable build on a crash, and records the build that runs."""
    target = venv_dir()
    (target / MARKER).unlink(missing_ok=True)
    print(f"building llama-cpp-python {VERSION} into {target} (compiles llama.cpp; several minutes)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
    exe = target / "bin" / "python"
    if capped():  # the AVX2-era sets this CPU runs, the rest off: never a native build
        isa = {o: ok for o, ok in probe_isa().items() if o in AVX2_ERA}
        install(target, cmake_args := portable_cmake_args(isa))
        if (failed := first_forward(exe, gguf)) is not None:
            raise SystemExit(f"llama.cpp anchor broken: the AVX2 build's first forward failed ({failed})")
        return _record(target, "avx2", cmake_args)
    if not portable:
        install(target, [])
        if (failed := first_forward(exe, gguf)) is None:
            return _record(target, "native", [])
        print(f"the native build's first forward failed ({failed}): building again with GGML_NATIVE=OFF",
              flush=True)
    isa = probe_isa()
    print("instruction sets that run here: " + (" ".join(o for o, ok in isa.items() if ok) or "none"), flush=True)
    cmake_args = portable_cmake_args(isa)
    install(target, cmake_args)
    if (failed := first_forward(exe, gguf)) is not None:
        raise SystemExit(f"llama.cpp anchor broken: the portable build's first forward failed too ({failed})")
    _record(target, "portable", cmake_args)


def _record(target: Path, build: str, cmake_args: list[str]) -> None:
    (target / MARKER).write_text(json.dumps({"version": VERSION, "build": build, "cmake_args": cmake_args}))
    print(f"done: the {build} build runs its first forward", flush=True)


def require() -> Path:
    """The anchor's python, or SystemExit with one line: the benchmarks that compare
    against llama.cpp stop rather than print their tables without it."""
    exe = python()
    if exe is None or not (venv_dir() / MARKER).exists():
        why = "missing" if exe is None else "not probed (or its build failed)"
        raise SystemExit(f"llama.cpp anchor {why} at {venv_dir()}: build it with python -m bench.llama_cpp --setup "
                         f"(or run without llama.cpp)")
    return exe


def anchor_output(done: subprocess.CompletedProcess, what: str) -> str:
    """The anchor's stdout, or SystemExit with one line when its run failed."""
    if done.returncode:
        why = f"killed by {signal.Signals(-done.returncode).name}" if done.returncode < 0 else \
            f"exit status {done.returncode}"
        last = (done.stderr.strip() or "no output").splitlines()[-1]
        raise SystemExit(f"llama.cpp anchor broken: {what} failed ({why}: {last})")
    return done.stdout


def probe(gguf: str) -> None:
    """The first forward ``setup`` checks: a short prompt in one ``llama_decode``, then
    one decode step; prints "ok" if both ran and the logits are finite."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 64
    params.n_threads = params.n_threads_batch = os.cpu_count()
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(32, 0, 1)
    token = 0
    for start, ids in ((0, list(range(1, 33))), (32, None)):
        ids = ids or [token]
        batch.n_tokens = len(ids)
        for i, t in enumerate(ids):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, start + i, 1, i == len(ids) - 1
            batch.seq_id[i][0] = 0
        if (rc := L.llama_decode(ctx, batch)) != 0:
            raise SystemExit(f"llama_decode failed: {rc}")
        logits = np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(ids) - 1), shape=(n_vocab,))
        if not np.isfinite(logits).all():
            raise SystemExit("llama.cpp's logits are not finite")
        token = int(np.argmax(logits))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print("ok")


def run(gguf: str, batch: int, prompt_len: int, new_tokens: int, repeats: int, threads: int,
        warmup: bool = True) -> None:
    """Greedy generation of ``batch`` sequences through llama.cpp's batch API: the
    prompts in one ``llama_decode`` (one sequence id each), then one ``llama_decode``
    a step carrying every sequence's next token, as our executor's batched step does.
    Prints the median run (by total time): its seconds, prefill seconds and each step's."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    if not model:
        raise SystemExit(f"llama.cpp could not load {gguf}")
    params = L.llama_context_default_params()
    params.n_ctx = batch * (prompt_len + new_tokens + 8)
    params.n_batch = max(batch * prompt_len, 512)
    # one ubatch holds a whole prompt up to 2,048 tokens; longer contexts go in parts of that
    # (the attention scratch grows with ubatch x context)
    params.n_ubatch = min(params.n_batch, 2048)
    params.n_seq_max = batch
    params.kv_unified = True  # one KV buffer shared by the sequences, as our pool is
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    tokens = L.llama_batch_init(batch * prompt_len, 0, 1)
    # bench.decode_throughput.prompts(batch, prompt_len): the same token ids as ours
    prompts = [[1 + (7 * b + 13 * i) % 4000 for i in range(prompt_len)] for b in range(batch)]

    def decode(entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """One llama_decode over (token, position, sequence, wants logits); greedy next tokens."""
        tokens.n_tokens = len(entries)
        for i, (token, pos, seq, wants) in enumerate(entries):
            tokens.token[i], tokens.pos[i], tokens.n_seq_id[i], tokens.logits[i] = token, pos, 1, wants
            tokens.seq_id[i][0] = seq
        if (rc := L.llama_decode(ctx, tokens)) != 0:
            raise SystemExit(f"llama_decode failed: {rc}")
        return [int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                for i, entry in enumerate(entries) if entry[3]]

    def once() -> tuple[float, float, list[float]]:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        start = time.perf_counter()
        nexts = decode([(t, i, s, i == prompt_len - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)])
        prefill, steps = time.perf_counter() - start, []
        for step in range(new_tokens - 1):
            began = time.perf_counter()
            nexts = decode([(t, prompt_len + step, s, True) for s, t in enumerate(nexts)])
            steps.append(time.perf_counter() - began)
        return time.perf_counter() - start, prefill, steps

    if warmup:
        once()
    runs = sorted((once() for _ in range(repeats)), key=lambda r: r[0])
    seconds, prefill, steps = runs[len(runs) // 2]
    resident = {"rss_mb": resident_mb("VmRSS"), "peak_rss_mb": resident_mb("VmHWM")}  # model and context alive
    L.llama_batch_free(tokens)
    L.llama_free(ctx)
    L.llama_model_free(model)
    print(json.dumps({"seconds": seconds, "prefill_s": prefill, "runs": [r[0] for r in runs],
                      "prefill_runs": [r[1] for r in runs], "steps_s": steps, **resident}))


def argmax_all(gguf: str, ids: list[int], threads: int) -> None:
    """The argmax of llama.cpp's logits at every position of ``ids``, one ``llama_decode``."""
    import llama_cpp as L
    import numpy as np

    L.llama_backend_init()
    model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
    params = L.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = len(ids) + 8
    params.n_threads = params.n_threads_batch = threads
    ctx = L.llama_init_from_model(model, params)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(len(ids), 0, 1)
    batch.n_tokens = len(ids)
    for i, token in enumerate(ids):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, True
        batch.seq_id[i][0] = 0
    if (rc := L.llama_decode(ctx, batch)) != 0:
        raise SystemExit(f"llama_decode failed: {rc}")
    print(json.dumps([int(np.argmax(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,))))
                      for i in range(len(ids))]))
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)


def resident_mb(key: str) -> float:
    """This process's resident set now (VmRSS) or at its peak (VmHWM), MiB; VmHWM starts
    afresh at exec (getrusage's ru_maxrss does not: it would report the forking benchmark's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setup", action="store_true")
    parser.add_argument("--portable", action="store_true",
                        help="with --setup: build with GGML_NATIVE=OFF and the probed instruction sets at once")
    parser.add_argument("--probe", action="store_true", help="the first forward --setup checks (prints ok)")
    parser.add_argument("--run", action="store_true")
    parser.add_argument("--argmax", action="store_true")
    parser.add_argument("--ids", help="JSON list of token ids, for --argmax")
    parser.add_argument("--gguf")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--no-warmup", action="store_true", help="--run: no warm-up run (long contexts)")
    args = parser.parse_args()
    if args.setup:
        from ferrum_rpc.server.prepare import find_gguf

        setup(Path(args.gguf) if args.gguf else find_gguf(), args.portable)
    if args.probe:
        probe(args.gguf)
    if args.run:
        run(args.gguf, args.batch, args.prompt_len, args.new_tokens, args.repeats, args.threads,
            not args.no_warmup)
    if args.argmax:
        argmax_all(args.gguf, json.loads(args.ids), args.threads)


if __name__ == "__main__":
    main()
