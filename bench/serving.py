"""Serving under load: many users at once against our server and against llama.cpp's own
``llama-server`` on the same Q4_1 GGUF, same threads, in one run; our server driven by
two callers in turn, the Python client and Ferrum's engine.

The workload is fixed by a seed: N requests a run, each a prompt of 100-1,500 token ids
(drawn from the vocabulary, new in every run, so no prefix is shared or cached) and 128
output tokens (greedy, no stop),
arriving as a Poisson process at each rate given.  Each request runs as a separate user's
would.  Three callers, each a row (``--callers``):

- ``python``: our server, each request in its own thread through the Python client's
  ``generate_ids`` (the decode-ahead path it picks by itself);
- ``ferrum``: our server, the same config in a fresh process (so none of the python
  row's prompts is in its prefix cache), every request submitted at its arrival to one
  Ferrum ContinuousEngine over RemoteExecutor (clients/rust's ``ferrum-engine-load``,
  built first into the tests' cargo target folder), each streamed, one chunk a token
  as the engine step that chose it ends;
- ``llama``: llama-server, a streamed ``/completion`` per request.

Times are taken as each token reaches the caller, from the request's scheduled arrival.

Reported per server and rate: output tokens/s (all requests' tokens over the time from
the first arrival to the last token), time to first token p50/p99, inter-token latency
p50/p99, and the highest rate each server holds with p99 inter-token latency under
200 ms and p99 time to first token under 2 s (and, beside it, under the inter-token
bound alone: a streaming user who waits for the first token but not between tokens).
Before the rates, an "alone" run sends each of N other prompts when the one before has
finished: a lone user's latency, the floor under every rate's; a server whose lone
requests miss the bound holds no rate.  Writes bench/results/serving.json and, with
matplotlib, bench/results/serving.png (latency against load).

llama-server is built once, outside CI, from the llama.cpp source inside the
llama-cpp-python sdist (``--build-llama-server``, about ten minutes on 2 cores), with
continuous batching and one ``--parallel`` slot per request a rate can have in flight.

    python -m bench.serving --build-llama-server     # once
    python -m bench.serving [--requests 16] [--rates 0.25 0.5 1 2 3 0]   # 0: all 16 at once
        [--no-alone] [--callers python ferrum llama] [--out serving]
        [--engine-step-tokens 128 2048] [--engine-trace DIR]   # a ferrum row per step budget
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from bench.common import RESULTS, log, served, write_results
from bench.llama_cpp import VERSION as LLAMA_CPP_PYTHON
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.paths import cache_root
from ferrum_rpc.server.prepare import find_gguf, prepare_default_model

OUTPUT_TOKENS = 128
PROMPT_TOKENS = (100, 1500)
ITL_P99_S, TTFT_P99_S = 0.200, 2.0  # the latency a user accepts: what "holds a rate" means


def llama_server_dir() -> Path:
    return cache_root() / "llama-server"


def llama_server_binary() -> Path:
    return llama_server_dir() / "build" / "bin" / "llama-server"


def build_llama_server() -> Path:
    """Builds llama-server from the sdist's llama.cpp (native CPU flags) into the cache folder."""
    folder = llama_server_dir()
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / f"llama_cpp_python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    if not source.exists():
        subprocess.run(["pip", "download", "--no-deps", "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
                        "-d", str(folder)], check=True)
        subprocess.run(["tar", "xzf", f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"], cwd=folder, check=True)
    subprocess.run(["cmake", "-S", str(source), "-B", str(folder / "build"), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_OPENSSL=OFF"], check=True)
    subprocess.run(["cmake", "--build", str(folder / "build"), "--target", "llama-server", f"-j{os.cpu_count()}"],
                   check=True)
    return llama_server_binary()


# -- the workload -----------------------------------------------------------------------------


def prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of token ids drawn from ``vocab`` (above the special tokens)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, n)
    return [rng.integers(100, vocab - 100, int(length)).tolist() for length in lengths]


def arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of ``n`` requests arrives: a Poisson process,
    or (``rate`` 0) all at once, ``n`` concurrent requests."""
    if rate == 0:
        return [0.0] * n
    rng = np.random.default_rng([seed, int(rate * 1000)])
    return np.cumsum(rng.exponential(1.0 / rate, n)).tolist()


@dataclass
class Request:
    arrival: float  # perf_counter time it was due
    times: list[float] = field(default_factory=list)  # each output token's arrival at the caller
    error: str = ""


def run_rate(send, prompts_: list[list[int]], rate: float, seed: int) -> dict:
    """Sends every prompt at its Poisson arrival time (a thread each) and summarises.
    ``prompts_`` must be new to the server: a prefix-cache hit on an earlier run's
    prompt would time a prompt that was not computed."""
    start = time.perf_counter() + 0.2
    requests = [Request(start + t) for t in arrivals(len(prompts_), rate, seed)]

    def user(request: Request, prompt: list[int]) -> None:
        delay = request.arrival - time.perf_counter()
        if delay > 0:
            time.sleep(delay)  # the arrival process itself, not a wait for a condition
        try:
            send(prompt, request.times)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            request.error = f"{type(exc).__name__}: {exc}"

    threads = [threading.Thread(target=user, args=(r, p), daemon=True) for r, p in zip(requests, prompts_)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=1800)
    return summarise(requests, rate, "poisson" if rate else "burst")


def run_alone(send, prompts_: list[list[int]]) -> dict:
    """Sends each prompt when the one before has finished: the latency a lone user sees,
    the floor under every rate's (a server whose lone requests miss the bound holds no
    rate)."""
    requests = []
    for prompt in prompts_:
        request = Request(time.perf_counter())
        try:
            send(prompt, request.times)
        except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
            request.error = f"{type(exc).__name__}: {exc}"
        requests.append(request)
    return summarise(requests, 0.0, "alone")


def summarise(requests: list[Request], rate: float, mode: str) -> dict:
    """One run's figures; ``mode`` says how its requests arrived: "poisson" at ``rate``,
    "burst" (all at once) or "alone" (each sent when the one before had finished)."""
    done = [r for r in requests if r.times and not r.error]
    ttft = [r.times[0] - r.arrival for r in done]
    itl = [b - a for r in done for a, b in zip(r.times, r.times[1:])]
    tokens = sum(len(r.times) for r in done)
    if mode == "alone":  # one request at a time, each perhaps on its own clock: their spans add
        span = sum(r.times[-1] - r.arrival for r in done)
    else:
        span = max(r.times[-1] for r in done) - min(r.arrival for r in requests) if done else float("nan")

    def pct(values, q):
        return float(np.percentile(values, q)) if values else float("nan")

    out = {"rate": rate, "mode": mode, "requests": len(requests), "completed": len(done),
           "errors": sorted({r.error for r in requests if r.error}),
           "output_tokens_per_s": tokens / span if done else 0.0,
           "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "itl_p50_s": pct(itl, 50),
           "itl_p99_s": pct(itl, 99), "output_tokens": tokens}
    out["holds_itl"] = bool(len(done) == len(requests) and out["itl_p99_s"] < ITL_P99_S)
    out["holds"] = bool(out["holds_itl"] and out["ttft_p99_s"] < TTFT_P99_S)
    return out


# -- the callers ------------------------------------------------------------------------------


def ours(target: str):
    """One user's request through the Python client's generate path."""
    greedy = SamplingParams(greedy=True)

    def send(prompt: list[int], times: list[float]) -> None:
        with ExecutorClient(target, timeout=600) as client:
            for _ in generate_ids(client, prompt, OUTPUT_TOKENS, greedy):
                times.append(time.perf_counter())
    return send


def engine_binary() -> Path:
    """clients/rust's ferrum-engine-load, built (a warm build only checks freshness) into
    the tests' cargo target folder."""
    from tests.contract.test_rust_client import CRATE, target_dir

    subprocess.run(["cargo", "build", "--release", "--bin", "ferrum-engine-load"], cwd=CRATE, check=True,
                   env={**os.environ, "CARGO_TARGET_DIR": str(target_dir()), "FERRUM_PYTHON": sys.executable})
    return target_dir() / "release" / "ferrum-engine-load"


def run_rate_engine(binary: Path, target: str, tokenizer: Path, prompts_: list[list[int]], rate: float,
                    seed: int, extra: tuple[str, ...] = ()) -> dict:
    """One rate's workload (the arrivals :func:`run_rate` uses) through Ferrum's engine;
    ``extra``: more of ferrum-engine-load's options (the step token budget, a scheduler
    trace)."""
    requests = engine_requests(binary, target, tokenizer, prompts_, arrivals(len(prompts_), rate, seed), extra)
    return summarise(requests, rate, "poisson" if rate else "burst")


def run_alone_engine(binary: Path, target: str, tokenizer: Path, prompts_: list[list[int]],
                     extra: tuple[str, ...] = ()) -> dict:
    """:func:`run_alone` through Ferrum's engine: one ferrum-engine-load run a request,
    each timed from its own run's start (after the engine is built)."""
    requests = [r for p in prompts_ for r in engine_requests(binary, target, tokenizer, [p], [0.0], extra)]
    return summarise(requests, 0.0, "alone")


def engine_requests(binary: Path, target: str, tokenizer: Path, prompts_: list[list[int]],
                    arrivals_s: list[float], extra: tuple[str, ...] = ()) -> list[Request]:
    """ferrum-engine-load submits each request at its arrival and reports each token's time
    on its own clock (seconds from its run's start, the arrivals' origin)."""
    workload = [{"arrival_s": t, "prompt_ids": p, "max_tokens": OUTPUT_TOKENS}
                for t, p in zip(arrivals_s, prompts_)]
    done = subprocess.run([str(binary), "--addr", target, "--tokenizer", str(tokenizer), *extra],
                          input=json.dumps(workload), capture_output=True, text=True, timeout=1800)
    lines = {line["index"]: line for line in map(json.loads, done.stdout.splitlines())}
    requests = []
    for i, item in enumerate(workload):
        line = lines.get(i, {"times": [], "error": f"no line (rc {done.returncode}): {done.stderr[-300:]}"})
        requests.append(Request(item["arrival_s"], line["times"], line["error"] or ""))
    if "released here" in done.stderr:
        log.warning("ferrum-engine-load: %s", done.stderr.strip()[-300:])
    return requests


def llama(port: int):
    """One user's request to llama-server's streamed /completion (greedy, no stop)."""
    def send(prompt: list[int], times: list[float]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
        body = json.dumps({"prompt": prompt, "n_predict": OUTPUT_TOKENS, "stream": True, "ignore_eos": True,
                           "temperature": 0.0, "top_k": 1, "cache_prompt": False})
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        reply = conn.getresponse()
        if reply.status != 200:
            raise RuntimeError(f"llama-server answered {reply.status}: {reply.read()[:200]!r}")
        for line in reply:
            if line.startswith(b"data: "):
                event = json.loads(line[6:])
                if event.get("stop"):
                    break
                times.append(time.perf_counter())
        conn.close()
    return send


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(gguf: Path, threads: int, slots: int):
    binary = llama_server_binary()
    if not binary.exists():
        raise SystemExit(f"no llama-server at {binary}: run python -m bench.serving --build-llama-server first")
    port = free_port()
    ctx = slots * (PROMPT_TOKENS[1] + OUTPUT_TOKENS + 16)
    proc = subprocess.Popen([str(binary), "-m", str(gguf), "-t", str(threads), "-tb", str(threads), "-c", str(ctx),
                             "-np", str(slots), "-cb", "--host", "127.0.0.1", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            with contextlib.suppress(OSError):
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("llama-server did not start")
            time.sleep(0.2)  # polling its health endpoint, with the deadline above
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def highest_held(rows: list[dict], key: str = "holds") -> float:
    """The highest Poisson rate below which every rate measured held the latency bound
    (``key`` "holds": both bounds; "holds_itl": the inter-token one alone); 0: not even
    the lowest, or the lone requests already missed it."""
    if any(r["mode"] == "alone" and not r[key] for r in rows):
        return 0.0
    held = 0.0
    for row in sorted((r for r in rows if r["mode"] == "poisson"), key=lambda r: r["rate"]):
        if not row[key]:
            break
        held = row["rate"]
    return held


def plot(results: dict[str, list[dict]], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for name, rows in results.items():
        rows = [r for r in rows if r["mode"] == "poisson"]
        rates = [r["rate"] for r in rows]
        axes[0].plot(rates, [r["ttft_p99_s"] for r in rows], "o-", label=name)
        axes[1].plot(rates, [1000 * r["itl_p99_s"] for r in rows], "o-", label=name)
        axes[2].plot(rates, [r["output_tokens_per_s"] for r in rows], "o-", label=name)
    axes[0].axhline(TTFT_P99_S, color="grey", ls=":")
    axes[1].axhline(1000 * ITL_P99_S, color="grey", ls=":")
    for ax, title in zip(axes, ("time to first token p99 (s)", "inter-token latency p99 (ms)", "output tokens/s")):
        ax.set_xlabel("arrival rate (requests/s)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    log.info("wrote %s", path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-llama-server", action="store_true")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0, 3.0, 0.0],
                        help="requests/s of each Poisson run; 0: every request at once")
    parser.add_argument("--no-alone", dest="alone", action="store_false",
                        help="skip the run that sends each request when the one before has finished")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--quantize", default="w4a8", help="our server's --quantize (llama.cpp runs the Q4_1 GGUF)")
    parser.add_argument("--out", "--name", dest="name", default="serving",
                        help="results name: bench/results/<out>.json and .png")
    parser.add_argument("--callers", nargs="+", choices=("python", "ferrum", "llama"),
                        default=["python", "ferrum", "llama"],
                        help="rows to run: our server through the Python client, through Ferrum's engine; "
                             "llama-server")
    parser.add_argument("--engine-binary", type=Path,
                        help="a ferrum-engine-load to run instead of building clients/rust's (recorded in the results)")
    parser.add_argument("--engine-step-tokens", type=int, nargs="+", default=[0],
                        help="the ferrum row's engine step token budgets (ferrum-engine-load --step-tokens), a "
                             "row each on a fresh server; 0: the program's default")
    parser.add_argument("--engine-trace", type=Path,
                        help="a folder for Ferrum's per-step scheduler traces of the ferrum rows "
                             "(ferrum-engine-load --scheduler-trace), one JSON-lines file a row and rate")
    args = parser.parse_args()
    if args.build_llama_server:
        print(build_llama_server())
        return
    model = prepare_default_model()
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    # each run its own prompts (the same ones for both servers): none is cached from an earlier run
    work = {rate: prompts(args.requests, args.seed * 1000 + i, vocab) for i, rate in enumerate(args.rates)}
    lone = prompts(args.requests, args.seed * 1000 + 999, vocab)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    results: dict[str, list[dict]] = {}
    binary = args.engine_binary or (engine_binary() if "ferrum" in args.callers else None)
    flags = ("--quantize", args.quantize, "--max-batch", str(args.requests), "--threads", str(args.threads))
    kv_tokens = args.requests * (PROMPT_TOKENS[1] + OUTPUT_TOKENS + 16)
    if "python" in args.callers:
        with served(str(model), "float32", flags, kv_tokens=kv_tokens) as target:
            results[f"ferrum-rpc {args.quantize}"] = (
                [run_alone(ours(target), lone)] if args.alone else []) + [
                run_rate(ours(target), work[r], r, args.seed) for r in args.rates]
    for step in args.engine_step_tokens if "ferrum" in args.callers else ():
        # A fresh server of the same config: the same prompts, none in its prefix cache.
        name = f"ferrum-engine {args.quantize}" + (f" step {step}" if step else "")

        def extra(run: str) -> tuple[str, ...]:
            budget = ("--step-tokens", str(step)) if step else ()
            if not args.engine_trace:
                return budget
            args.engine_trace.mkdir(parents=True, exist_ok=True)
            trace = args.engine_trace / f"{args.name}_step{step or 'default'}_{run}.jsonl"
            return (*budget, "--scheduler-trace", str(trace))

        with served(str(model), "float32", flags, kv_tokens=kv_tokens) as target:
            tokenizer = Path(model) / "tokenizer.json"
            results[name] = ([run_alone_engine(binary, target, tokenizer, lone, extra("alone"))] if args.alone else []) + [
                run_rate_engine(binary, target, tokenizer, work[r], r, args.seed, extra(f"rate{r:g}"))
                for r in args.rates]
    if "llama" in args.callers:
        with llama_server(find_gguf(), args.threads, args.requests) as port:
            results["llama-server Q4_1"] = ([run_alone(llama(port), lone)] if args.alone else []) + [
                run_rate(llama(port), work[r], r, args.seed) for r in args.rates]
    print(f"\n{cpu}, {args.threads} threads, {args.requests} requests a rate, prompts {PROMPT_TOKENS[0]}-"
          f"{PROMPT_TOKENS[1]} tokens, {OUTPUT_TOKENS} out")
    print(f"{'server':24} {'rate':>5} {'tok/s':>7} {'TTFT p50':>9} {'p99':>7} {'ITL p50':>8} {'p99':>7}  holds")
    for name, rows in results.items():
        for r in rows:
            rate = f"{r['rate']:5.2f}" if r["mode"] == "poisson" else r["mode"]
            print(f"{name:24} {rate:>5} {r['output_tokens_per_s']:7.1f} {r['ttft_p50_s']:8.2f}s "
                  f"{r['ttft_p99_s']:6.2f}s {1000 * r['itl_p50_s']:6.0f}ms {1000 * r['itl_p99_s']:5.0f}ms  "
                  f"{'yes' if r['holds'] else 'no'}{'  ' + '; '.join(r['errors']) if r['errors'] else ''}")
        print(f"{name:24} highest rate held: {highest_held(rows):.2f} requests/s "
              f"({highest_held(rows, 'holds_itl'):.2f} under the inter-token bound alone)")
    records = [{"server": name, **row} for name, rows in results.items() for row in rows]
    write_results(args.name, records, {"cpu": cpu, "requests": args.requests, "seed": args.seed,
                                       "output_tokens": OUTPUT_TOKENS, "prompt_tokens": PROMPT_TOKENS,
                                       "highest_held": {name: highest_held(rows) for name, rows in results.items()},
                                       "highest_held_itl_only": {name: highest_held(rows, "holds_itl")
                                                                 for name, rows in results.items()},
                                       "criterion": {"itl_p99_s": ITL_P99_S, "ttft_p99_s": TTFT_P99_S},
                                       **({"engine_binary": str(args.engine_binary)} if args.engine_binary else {}),
                                       **({"engine_step_tokens": args.engine_step_tokens}
                                          if "ferrum" in args.callers else {})})
    plot(results, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
