"""Other callers' decode steps while LoRA adapters load, on the real model through gRPC.

``ferrum-rpc serve`` of SmolLM2-135M (float32) in its own process; ``--decoders``
clients each decode one sequence, a token a call, the whole run.  Rounds alternate,
so both figures see the same machine: ``--idle-s`` seconds with nothing else, then
one LoadAdapter of a rank-64 adapter on every target module (``replace``), ``--loads``
times.  A decode call counts as idle when it lies inside an idle window, as "during
a load" when its time at the client overlaps a load.  Printed:
the idle p50, the during-load p50, their ratio (target: at most 1.5), the loads' wall
times and the CPU model; written to ``bench/results/<--out>.json``.

    .venv/bin/python -m bench.adapter_load [--decoders 4] [--loads 12] [--rank 64]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

from bench.common import log, served, write_results
from bench.lora import make_adapters
from ferrum_rpc.client import DecodeInput, ExecutorClient, TokenChoice
from ferrum_rpc.paths import default_model_dir

GREEDY = TokenChoice(temperature=0.0)
TARGET_RATIO = 1.5


def cpu_model() -> str:
    """The first "model name" of /proc/cpuinfo, and how many processors it lists."""
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0] if names else 'unknown'} x{len(names)}"


def decoder(target: str, prompt: list[int], stop: threading.Event, calls: list[tuple[float, float]]) -> None:
    """Decodes one sequence a token a call until ``stop``; each call's (start, end)."""
    with ExecutorClient(target, timeout=120) as client:
        out = client.prefill(prompt, token_choice=GREEDY)
        item = DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)
        while not stop.is_set():
            if item.kv_cache.sequence_length > 1500:
                client.release_cache(item.kv_cache)
                out = client.prefill(prompt, token_choice=GREEDY)
                item = DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)
            start = time.perf_counter()
            step = client.decode(item.token_id, item.kv_cache, token_choice=GREEDY)
            calls.append((start, time.perf_counter()))
            item = DecodeInput(step.chosen.token_id, step.kv_cache, GREEDY)
        client.release_cache(item.kv_cache)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decoders", type=int, default=4)
    parser.add_argument("--loads", type=int, default=12)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--idle-s", type=float, default=1.5)
    parser.add_argument("--out", default="adapter_load")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = default_model_dir()
    cpu = cpu_model()
    with tempfile.TemporaryDirectory() as tmp, served(str(model_dir), "float32", ("--max-adapters", "2")) as target, \
            ExecutorClient(target, timeout=120) as admin:
        adapter = make_adapters(Path(model_dir), Path(tmp), 1, args.rank)[0]
        admin.load_adapter("warm", str(adapter))  # the first load pays one-time costs; not measured
        admin.unload_adapter("warm")
        stop = threading.Event()
        calls: list[list[tuple[float, float]]] = [[] for _ in range(args.decoders)]
        threads = [threading.Thread(target=decoder, args=(target, [1, 504, 3458, 28, 1000 + i], stop, calls[i]))
                   for i in range(args.decoders)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 120
        while not all(len(c) >= 3 for c in calls):  # every decoder past its prompt and first steps
            if time.monotonic() > deadline:
                raise RuntimeError("the decoders never got going")
            time.sleep(0.05)
        idle_windows, windows, load_s, server_s = [], [], [], []
        for n in range(args.loads):
            idle_from = time.perf_counter()
            time.sleep(args.idle_s)
            idle_windows.append((idle_from, time.perf_counter()))
            start = time.perf_counter()
            entry = admin.load_adapter("bench", str(adapter), replace=n > 0)
            end = time.perf_counter()
            windows.append((start, end))
            load_s.append(end - start)
            server_s.append(entry.load_s)
        stop.set()
        for t in threads:
            t.join(120)
    every = [c for per in calls for c in per]
    idle = [e - s for s, e in every if any(s >= w_start and e <= w_end for w_start, w_end in idle_windows)]
    during = [e - s for s, e in every if any(s < w_end and e > w_start for w_start, w_end in windows)]
    idle_p50, during_p50 = statistics.median(idle), statistics.median(during)
    ratio = during_p50 / idle_p50
    print(f"CPU: {cpu}")
    print(f"decoders: {args.decoders}; rank-{args.rank} loads: {args.loads}, "
          f"{1000 * statistics.median(load_s):.0f} ms p50 at the client ({1000 * statistics.median(server_s):.0f} "
          f"ms on the server)")
    print(f"idle decode p50:        {1000 * idle_p50:.1f} ms ({len(idle)} calls)")
    print(f"during-load decode p50: {1000 * during_p50:.1f} ms ({len(during)} calls)")
    print(f"ratio: {ratio:.2f} (target <= {TARGET_RATIO})")
    record = {"decoders": args.decoders, "rank": args.rank, "loads": args.loads,
              "idle_p50_ms": round(1000 * idle_p50, 2), "during_load_p50_ms": round(1000 * during_p50, 2),
              "ratio": round(ratio, 3), "target_ratio": TARGET_RATIO, "idle_calls": len(idle),
              "during_load_calls": len(during), "load_p50_ms": round(1000 * statistics.median(load_s), 1),
              "server_load_p50_ms": round(1000 * statistics.median(server_s), 1)}
    write_results(args.out, [record], meta={"cpu_model": cpu})
    log.info("%s", record)


if __name__ == "__main__":
    main()
