"""Wire cost on loopback: GetStatus round trip, and logits transfer throughput,
through the reply (gRPC) and through a registered shared-memory region.

Transfer time is the client-observed call time minus the server's queue and
forward time (``timing.queue_ns + forward_ns``): everything it takes to get
the rows from the model's output to a numpy array in the caller (conversion,
the copy into the reply or into shared memory, serialisation, the socket,
parsing); throughput is logits payload bytes over that time.

    python -m bench.wire [--positions 256]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import numpy as np

from bench.common import log, served, write_results
from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.server.prepare import prepare_default_model


def status_latency(ex: ExecutorClient, calls: int) -> dict:
    ex.status()
    lat = []
    for _ in range(calls):
        t0 = time.perf_counter()
        ex.status()
        lat.append((time.perf_counter() - t0) * 1000)
    return {"system": "grpc", "rpc": "GetStatus", "p50_ms": round(float(np.percentile(lat, 50)), 3),
            "p99_ms": round(float(np.percentile(lat, 99)), 3)}


def logits_throughput(ex: ExecutorClient, policy: LogitsPolicy, name: str, positions: int, repeats: int,
                      path: str = "grpc") -> dict:
    prompt = [1 + (13 * i) % 4000 for i in range(positions)]
    rates, sizes = [], []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        out = ex.prefill(prompt, logits=policy)
        values = np.asarray(out.logits.values)  # what the caller gets: an array (a view for float32 in shm)
        wall = time.perf_counter() - t0
        ex.release_cache(out.kv_cache)
        payload = values.nbytes if "bfloat16" not in name else values.size * 2
        if out.logits.token_ids is not None:
            payload += out.logits.token_ids.size * 4
        transfer = wall - (out.timing.queue_ns + out.timing.forward_ns) / 1e9
        rates.append(payload / transfer / 1e6)
        sizes.append(payload)
    rate = statistics.median(rates[1:])
    return {"system": path, "logits": name, "positions": positions, "payload_mb": round(sizes[-1] / 1e6, 2),
            "mb_per_s": round(rate, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--positions", type=int, default=256, help="prompt positions whose logits are returned")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="wire")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    records = []
    with served(str(prepare_default_model()), "float32") as target, ExecutorClient(target, timeout=600) as ex:
        records.append(status_latency(ex, 500))
        log.info("GetStatus round trip: p50 %.3f ms, p99 %.3f ms", records[0]["p50_ms"], records[0]["p99_ms"])
        policies = {
            "float32": LogitsPolicy.full("float32", all_positions=True),
            "float16": LogitsPolicy.full("float16", all_positions=True),
            "bfloat16": LogitsPolicy.full("bfloat16", all_positions=True),
            "top20": LogitsPolicy.topk(20, all_positions=True),
        }
        for name, policy in policies.items():
            rec = logits_throughput(ex, policy, name, args.positions, args.repeats)
            records.append(rec)
            log.info("logits %-8s %7.1f MB payload via the reply: %8.1f MB/s", name, rec["payload_mb"],
                     rec["mb_per_s"])
        region_bytes = args.positions * ex.info().vocab_size * 4
        with ex.shared_memory(region_bytes) as region:
            for name in ("float32", "bfloat16"):
                policy = LogitsPolicy.full(name, all_positions=True, shared_memory=region.target())
                rec = logits_throughput(ex, policy, name, args.positions, args.repeats, path="shared-memory")
                records.append(rec)
                log.info("logits %-8s %7.1f MB payload via shared memory: %8.1f MB/s", name, rec["payload_mb"],
                         rec["mb_per_s"])
    write_results(args.out, records)


if __name__ == "__main__":
    main()
