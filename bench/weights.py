"""UpdateWeights on the real model through gRPC: every tensor of SmolLM2-135M (float32,
from a client on loopback) replaced while one caller decodes, and a rank-16 LoRA
adapter loaded through LoadAdapter.

Printed per round: the update's wall time at the client (serializing, streaming,
checking, rebuilding, swapping), the server's rebuild and pause (no forward ran), and
the longest gap between two tokens of the decoding caller, against its median gap;
then LoadAdapter's wall time.  Targets: the update < 3 s, decoding paused < 1 s, the
adapter < 0.5 s.

    .venv/bin/python -m bench.weights [--rounds 3] [--quantize none]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from bench.common import log, served, write_results
from bench.lora import make_adapters
from ferrum_rpc.client import DecodeInput, ExecutorClient, TokenChoice
from ferrum_rpc.paths import default_model_dir

GREEDY = TokenChoice(temperature=0.0)


def decode_gaps(target: str, stop: threading.Event, gaps: list[float]) -> None:
    """Decodes one sequence a token at a time until ``stop``, recording the gap before each token."""
    with ExecutorClient(target, timeout=60) as client:
        out = client.prefill([1, 504, 3458, 28, 1000], token_choice=GREEDY)
        item = DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)
        last = time.perf_counter()
        while not stop.is_set():
            if item.kv_cache.sequence_length > 1800:
                client.release_cache(item.kv_cache)
                out = client.prefill([1, 504, 3458, 28, 1000], token_choice=GREEDY)
                item = DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)
            step = client.decode(item.token_id, item.kv_cache, token_choice=GREEDY)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            item = DecodeInput(step.chosen.token_id, step.kv_cache, GREEDY)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quantize", default="none")
    parser.add_argument("--out", default="weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_dir = default_model_dir()
    original = load_file(str(Path(model_dir) / "model.safetensors"))
    rng = np.random.default_rng(0)
    versions = [{n: (t + rng.normal(0, 1e-3, t.shape)).astype(t.dtype) for n, t in original.items()}
                for _ in range(2)]
    nbytes = sum(t.nbytes for t in original.values())
    extra = ("--quantize", args.quantize) if args.quantize != "none" else ()
    records = []
    with tempfile.TemporaryDirectory() as tmp, served(str(model_dir), "float32", extra) as target, \
            ExecutorClient(target, timeout=120) as client:
        adapter = make_adapters(Path(model_dir), Path(tmp), 1, 16)[0]
        for r in range(args.rounds):
            gaps: list[float] = []
            stop = threading.Event()
            decoder = threading.Thread(target=decode_gaps, args=(target, stop, gaps))
            decoder.start()
            time.sleep(2.0)
            start = time.perf_counter()
            reply = client.update_weights(versions[r % 2])
            wall = time.perf_counter() - start
            time.sleep(1.0)
            stop.set()
            decoder.join()
            record = {"round": r, "tensors": reply.tensors, "bytes": nbytes, "wall_s": round(wall, 3),
                      "rebuild_s": round(reply.rebuild_s, 3), "paused_s": round(reply.paused_s, 3),
                      "longest_token_gap_s": round(max(gaps), 3),
                      "median_token_gap_s": round(statistics.median(gaps), 4)}
            log.info("update %d: %d tensors (%.0f MiB) in %.2f s at the client; rebuild %.2f s, paused %.2f s; "
                     "the decoder's longest gap %.2f s (median %.1f ms)", r, reply.tensors, nbytes / 2**20, wall,
                     reply.rebuild_s, reply.paused_s, max(gaps), 1000 * statistics.median(gaps))
            records.append(record)
        for r in range(args.rounds):
            start = time.perf_counter()
            entry = client.load_adapter(f"r16-{r}", str(adapter))
            wall = time.perf_counter() - start
            log.info("LoadAdapter rank %d: %.3f s at the client (%.3f s on the server), %.1f MiB", entry.rank, wall,
                     entry.load_s, entry.bytes / 2**20)
            records.append({"load_adapter_s": round(wall, 3), "server_load_s": round(entry.load_s, 3),
                            "adapter_bytes": entry.bytes})
    write_results(args.out, records)


if __name__ == "__main__":
    main()
