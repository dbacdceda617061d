"""Draws bench/results/*.json into bench/results/benchmarks.png.

    python -m bench.plot
"""

from __future__ import annotations

import json

from bench.common import RESULTS


def main() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    decode = json.loads((RESULTS / "decode_throughput.json").read_text())["records"]
    conc_path = RESULTS / "concurrency.json"
    conc = json.loads(conc_path.read_text())["records"] if conc_path.exists() else []
    dtypes = sorted({r["dtype"] for r in decode})
    systems = ["transformers", "executor", "grpc"]
    labels = {"transformers": "transformers generate", "executor": "executor in-process", "grpc": "executor via gRPC"}
    fig, axes = plt.subplots(1, len(dtypes) + bool(conc), figsize=(5.5 * (len(dtypes) + bool(conc)), 4.2))
    for ax, dtype in zip(axes, dtypes):
        batches = sorted({r["batch"] for r in decode if r["dtype"] == dtype})
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [next((r["tokens_per_s"] for r in decode if (r["system"], r["dtype"], r["batch"]) ==
                            (system, dtype, b)), 0) for b in batches]
            ax.bar([x + i * width for x in range(len(batches))], values, width, label=labels[system])
        ax.set_xticks([x + width for x in range(len(batches))], [f"batch {b}" for b in batches])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"SmolLM2-135M decode, {dtype}")
        ax.legend(fontsize=8)
    if conc:
        ax = axes[-1]
        callers = [r["callers"] for r in conc]
        ax.plot(callers, [r["tokens_per_s"] for r in conc], marker="o", label="aggregate tokens/s")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("independent callers (gRPC)")
        ax.set_ylabel("tokens/s")
        ax2 = ax.twinx()
        ax2.plot(callers, [r["p99_ms"] for r in conc], marker="x", color="tab:red", label="p99 step ms")
        ax2.set_ylabel("p99 step latency (ms)")
        ax.set_title("Concurrent callers, dynamic batching")
        ax.legend(loc="upper left", fontsize=8)
        ax2.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = RESULTS / "benchmarks.png"
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
