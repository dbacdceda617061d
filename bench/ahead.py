"""Decoding ahead through gRPC against the same run in process, batch 1.

For each variant (a dtype or a quantization of the default model), one greedy
generation of ``--new-tokens`` tokens after a 32-token prompt:

- ``in_process``: the run inside this process's model worker (``start_ahead``), its
  tokens taken off the run's queue by a plain thread: the engine alone;
- ``in_process_steps``: one decode job a token through the same worker (the
  executor row of ``bench.decode_throughput``);
- ``grpc_ahead``: ``ferrum-rpc serve`` in its own process, one DecodeSession step
  decoding ahead (``ExecutorClient.decode_ahead`` with no ``on_token``: 16 forwards'
  tokens a response, ``DecodeSessionRequest.forwards_per_response``);
- ``grpc_ahead_streamed``: the same with an ``on_token`` watching each token as it
  comes (one response per forward);
- ``grpc_steps``: the same server, one unary Decode a token.

Tokens/s counts the decoded tokens over the decode's wall time (the prompt is
left out), median of ``--repeats`` rounds.  The in-process worker and the server
(same configuration, same KV pool) are both up, idle while the other runs, and the
rows take turns within each round, so a host whose speed drifts moves every row
alike; the gRPC/in-process figure is the median of the rounds' own ratios.  For the gRPC rows the server
process's CPU time per token (user + system, /proc, the call's prefill and release
included) and this process's are recorded too: the CPU a message costs is what the
forwards lose on a host whose cores they share.

    .venv/bin/python -m bench.ahead [--variants float32 w4a8] [--new-tokens 128] [--repeats 5]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import threading
import time
from pathlib import Path

from bench.common import bench_server, dtype_and_quantize, log, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.types import DecodeInput, LogitsPolicy, TokenChoice

GREEDY = TokenChoice(temperature=0.0)
PROMPT = [(17 * i + 5) % 4000 + 100 for i in range(32)]
TARGET = 0.95  # grpc_ahead over in_process


def in_process(worker: ModelWorker, new_tokens: int, ahead: bool) -> float:
    first = worker.submit_prefill(PROMPT, None, None, choice=GREEDY).result()
    item = DecodeInput(first.chosen.token_id, first.kv_cache, GREEDY)
    start = time.perf_counter()
    if ahead:
        ready = threading.Event()
        run = worker.start_ahead([item], new_tokens, frozenset(), "", None)
        run.on_entry = ready.set  # the worker wakes the consumer, as the RPC layer's event loop is woken
        taken = 0
        while not run.done:
            ready.clear()
            if (entry := run.take()) is None:
                ready.wait()
            else:
                taken += len(entry)
        assert taken == new_tokens
        last = run.last[0].kv_cache
    else:
        for _ in range(new_tokens):
            out = worker.submit_decode([item], None).result()[0]
            item = DecodeInput(out.chosen.token_id, out.kv_cache, GREEDY)
        last = item.kv_cache
    elapsed = time.perf_counter() - start
    worker.submit(worker.executor.release_cache, last.cache_id).result()
    return elapsed


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU time so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def through_grpc(client: ExecutorClient, new_tokens: int, ahead: bool, streamed: bool = False) -> float:
    first = client.prefill(PROMPT, logits=LogitsPolicy.argmax())
    token, handle = first.logits.argmax()[0], first.kv_cache
    start = time.perf_counter()
    if ahead:
        seen = []
        end = client.decode_ahead(token, handle, GREEDY, new_tokens, on_token=seen.append if streamed else None)
        assert len(end.chosen) == new_tokens
        handle = end.kv_cache
    else:
        for _ in range(new_tokens):
            out = client.decode(token, handle, token_choice=GREEDY)
            token, handle = out.chosen.token_id, out.kv_cache
    elapsed = time.perf_counter() - start
    client.release_cache(handle)
    return elapsed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["float32", "w4a8"])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="ahead")
    args = parser.parse_args(argv)
    model_dir = str(prepare_default_model())
    records = []
    for variant in args.variants:
        dtype, quantize = dtype_and_quantize(variant)
        config = ExecutorConfig(dtype=dtype, kv_tokens=32768, quantize=quantize)
        extra = ("--quantize", quantize) if quantize != "none" else ()
        worker = ModelWorker(functools.partial(TorchExecutor.from_path, "bench", model_dir, config), "bench")
        worker.loaded.result()
        try:
            with bench_server(model_dir, dtype, 32768, *extra) as server:
                server.wait_serving(300)
                with ExecutorClient(server.target) as client:
                    calls = {"in_process": functools.partial(in_process, worker, args.new_tokens, True),
                             "in_process_steps": functools.partial(in_process, worker, args.new_tokens, False)}
                    for name, ahead, streamed in (("grpc_ahead", True, False), ("grpc_ahead_streamed", True, True),
                                                  ("grpc_steps", False, False)):
                        calls[name] = functools.partial(through_grpc, client, args.new_tokens, ahead, streamed)
                    for call in calls.values():
                        call()  # warm: the first forwards of a process are slow
                    # the rows take turns, round after round, so a host that drifts moves them all
                    seconds = {name: [] for name in calls}
                    cpu = {name: [0.0, 0.0] for name in calls if name.startswith("grpc")}
                    for _ in range(args.repeats):
                        for name, call in calls.items():
                            server_cpu, client_cpu = cpu_seconds(server.pid), time.process_time()
                            seconds[name].append(call())
                            if name in cpu:
                                cpu[name][0] += cpu_seconds(server.pid) - server_cpu
                                cpu[name][1] += time.process_time() - client_cpu
        finally:
            worker.stop()
        tps = {name: args.new_tokens / statistics.median(values) for name, values in seconds.items()}
        per_round = [a / b for a, b in zip(seconds["in_process"], seconds["grpc_ahead"])]
        ratio = statistics.median(per_round)
        cpu_ms = {name: {"server": round(s * 1e3 / (args.repeats * args.new_tokens), 3),
                         "client": round(c * 1e3 / (args.repeats * args.new_tokens), 3)}
                  for name, (s, c) in cpu.items()}
        log.info("%s batch 1: %s; grpc_ahead / in_process %.3f (median of the rounds' ratios; target >= %.2f), "
                 "streamed %.3f; CPU ms a token %s", variant, ", ".join(f"{n} {v:.1f} tok/s" for n, v in tps.items()),
                 ratio, TARGET, tps["grpc_ahead_streamed"] / tps["in_process"], cpu_ms)
        records.append({"variant": variant, "batch": 1, "new_tokens": args.new_tokens,
                        "tokens_per_s": {n: round(v, 2) for n, v in tps.items()},
                        "cpu_ms_per_token": cpu_ms,
                        "grpc_ahead_vs_in_process": round(ratio, 3),
                        "grpc_ahead_vs_in_process_rounds": [round(r, 3) for r in per_round],
                        "grpc_ahead_streamed_vs_in_process": round(tps["grpc_ahead_streamed"] / tps["in_process"], 3),
                        "grpc_ahead_vs_in_process_steps": round(tps["grpc_ahead"] / tps["in_process_steps"], 3)})
    write_results(args.out, records)


if __name__ == "__main__":
    main()
