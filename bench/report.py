"""Prints the README's benchmark tables (markdown) from bench/results/*.json.

    python -m bench.report
"""

from __future__ import annotations

import json

from bench.common import RESULTS


def _load(name: str) -> list[dict]:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text())["records"] if path.exists() else []


def decode_rows(records: list[dict]) -> list[dict]:
    """bench.decode_throughput's decode rows (not its prompt and long-context rows)."""
    return [r for r in records if r.get("kind", "decode") == "decode"]


def decode_table(records: list[dict]) -> str:
    records = decode_rows(records)
    by = {(r["system"], r["dtype"], r["batch"]): r for r in records}
    lines = ["| dtype | batch | transformers `generate` | executor in-process | executor via gRPC "
             "| gRPC / in-process | gRPC / transformers | decode-only gRPC / transformers |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for dtype, batch in sorted({(r["dtype"], r["batch"]) for r in records}):
        hf, ex, g = (by.get((s, dtype, batch)) for s in ("transformers", "executor", "grpc"))
        if not (hf and ex and g):
            continue
        lines.append(
            f"| {dtype} | {batch} | {hf['tokens_per_s']:.1f} | {ex['tokens_per_s']:.1f} | {g['tokens_per_s']:.1f} "
            f"| {g['tokens_per_s'] / ex['tokens_per_s']:.2f} | {g['tokens_per_s'] / hf['tokens_per_s']:.2f} "
            f"| {g['decode_tokens_per_s'] / hf['decode_tokens_per_s']:.2f} |")
    return "\n".join(lines)


def step_table(records: list[dict]) -> str:
    """Our rows (in process, gRPC, gRPC decoding ahead) of every variant and llama.cpp:
    throughput, the ratios the targets name (end to end and decode-only against
    llama.cpp at the same batch; "taking turns": the median of the rounds' own ratios, where
    llama.cpp ran, or the bandwidth was probed, in each round), and the decode step split
    into weight reads and the rest."""
    by = {(r["system"], r["dtype"], r["batch"]): r for r in records}
    lines = ["| system | variant | batch | tokens/s | decode tokens/s | / transformers float32 | / llama.cpp "
             "| decode / llama.cpp | taking turns: / llama.cpp, decode | taking turns: step / weight reads | step ms "
             "| weight-read ms | not weight reads | RSS MiB | peak RSS MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    records = decode_rows(records)
    rows = [r for r in records if r["system"] in ("executor", "grpc", "grpc-ahead", "llama.cpp")]
    for r in sorted(rows, key=lambda r: (r["batch"], r["system"], r["dtype"])):
        hf = by.get(("transformers", "bfloat16" if r["dtype"] == "bfloat16" else "float32", r["batch"]))
        vs_hf = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}" if hf and r["system"] != "llama.cpp" else "-"
        anchor = by.get(("llama.cpp", "Q4_1", r["batch"]))  # llama.cpp at the same batch size
        vs_llama = f"{r['tokens_per_s'] / anchor['tokens_per_s']:.2f}" if anchor else "-"
        decode_vs = f"{r['decode_tokens_per_s'] / anchor['decode_tokens_per_s']:.2f}" if anchor else "-"
        fmt = lambda key, spec="{:.1f}": spec.format(r[key]) if key in r else "-"  # noqa: E731
        turns = r.get("per_round_vs", {})
        turns = f"{turns['llama.cpp']:.2f}, {turns['llama.cpp_decode']:.2f}" if "llama.cpp" in turns else "-"
        floor = f"{r['per_round_floor']['step_vs_weight_reads']:.2f}" if "per_round_floor" in r else "-"
        lines.append(f"| {r['system']} | {r['dtype']} | {r['batch']} | {r['tokens_per_s']:.1f} "
                     f"| {r['decode_tokens_per_s']:.1f} | {vs_hf} | {vs_llama} | {decode_vs} | {turns} | {floor} "
                     f"| {fmt('step_ms')} | {fmt('weight_read_ms')} | {fmt('rest_fraction', '{:.0%}')} "
                     f"| {fmt('rss_mb', '{:.0f}')} | {fmt('peak_rss_mb', '{:.0f}')} |")
    return "\n".join(lines)


def limits_table(records: list[dict]) -> str:
    """Every row of bench.decode_throughput (decode, prompt, long-context decode) beside
    its limit: what bounds it, the time that alone takes, and the share of it reached."""
    lines = ["| kind | system | variant | batch | tokens | tokens/s | ms | limit | limit ms | share of limit |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    order = {"decode": 0, "prompt": 1, "context": 2}
    rows = [r for r in records if "limit_share" in r]
    for r in sorted(rows, key=lambda r: (order[r.get("kind", "decode")], r.get("prompt_tokens", r.get("context", 0)),
                                         r["batch"], r["dtype"], r["system"])):
        kind = r.get("kind", "decode")
        tokens = {"decode": r.get("prompt_len"), "prompt": r.get("prompt_tokens"), "context": r.get("context")}[kind]
        ms = r["ms"] if kind == "prompt" else r["step_ms"]
        rate = r["decode_tokens_per_s"] if kind == "decode" else r["tokens_per_s"]
        lines.append(f"| {kind} | {r['system']} | {r['dtype']} | {r['batch']} | {tokens} | {rate:.1f} | {ms:.2f} "
                     f"| {r['limit']} | {r['limit_ms']:.2f} | {r['limit_share']:.0%} |")
    return "\n".join(lines)


def concurrency_table(records: list[dict]) -> str:
    lines = ["| callers | tokens/s | x one caller | p50 step ms | p99 step ms | mean batch |",
             "| --- | --- | --- | --- | --- | --- |"]
    base = records[0]["tokens_per_s"] if records else 1
    for r in records:
        lines.append(f"| {r['callers']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f} "
                     f"| {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | {r['mean_batch']:.1f} |")
    return "\n".join(lines)


def wire_lines(records: list[dict]) -> str:
    out = []
    for r in records:
        if r.get("rpc") == "GetStatus":
            out.append(f"- GetStatus round trip: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms")
        elif "logits" in r:
            ms = r["payload_mb"] / r["mb_per_s"] * 1000
            via = "shared memory" if r["system"] == "shared-memory" else "the reply"
            out.append(f"- logits {r['logits']} via {via} ({r['positions']} positions, {r['payload_mb']:.2f} MB): "
                       f"transfer {ms:.1f} ms, {r['mb_per_s']:.0f} MB/s")
    return "\n".join(out)


def mixed_table(records: list[dict]) -> str:
    lines = ["| load | budget | decode p50 ms | decode p99 ms | decode tokens/s | prompt tokens/s |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in records:
        load = f"{r['decoders']} decoders" + (f" + {r['prompters']} prompters" if r["prompters"] else "")
        budget = "-" if not r["prompters"] else r.get("step_token_budget", "-")
        prompt = f"{r['prompt_tokens_per_s']:.1f}" if r["prompters"] else "-"
        lines.append(f"| {load} | {budget} | {r['decode_p50_ms']:.1f} | {r['decode_p99_ms']:.1f} "
                     f"| {r['decode_tokens_per_s']:.1f} | {prompt} |")
    return "\n".join(lines)


def failover_table(records: list[dict]) -> str:
    """Medians per history length of bench.failover's runs."""
    import statistics

    lines = ["| history tokens | decode step ms | prefill of the history ms | kill -> process gone ms "
             "| kill -> next token ms | added ms |", "| --- | --- | --- | --- | --- | --- |"]
    for history in sorted({r["history"] for r in records}):
        runs = [r for r in records if r["history"] == history]
        med = {k: statistics.median(r[k] for r in runs) * 1e3 for k in ("decode_s", "prefill_s", "reaped_s",
                                                                        "failover_s")}
        lines.append(f"| {history} | {med['decode_s']:.1f} | {med['prefill_s']:.1f} | {med['reaped_s']:.1f} "
                     f"| {med['failover_s']:.1f} | {med['failover_s'] - med['decode_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    print(decode_table(_load("decode_throughput")), end="\n\n")
    print(step_table(_load("decode_throughput")), end="\n\n")
    print(limits_table(_load("decode_throughput")), end="\n\n")
    print(concurrency_table(_load("concurrency")), end="\n\n")
    print(wire_lines(_load("wire")), end="\n\n")
    print(mixed_table(_load("mixed")), end="\n\n")
    print(failover_table(_load("failover")), end="\n\n")
    token_choice = _load("token_choice")
    if token_choice:
        from bench.token_choice import markdown

        summary = next((r for r in token_choice if "cpu" in r), {})
        meta = json.loads((RESULTS / "token_choice.json").read_text())["meta"]
        print(markdown(token_choice, summary.get("cpu", "?"), meta["time"]))


if __name__ == "__main__":
    main()
