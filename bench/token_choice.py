"""Server-side token choice against caller-side sampling, side by side in one run
: the default model served in its own process, prompt 32 tokens, 64 new
tokens, batches of 1, 8 and 32, temperature 0.8.

Variants, each a Prefill of the batch's prompts (one BatchPrefill call) then one
BatchDecode call a step for every sequence together:

- ``caller``: FULL float32 logits come back (one stream message per sequence, as
  the client asks for full rows) and the caller samples each row with
  ``client/sampling.py`` (``Sampler``, temperature 0.8, its own seed per sequence).
- ``server``: each item carries a seeded ``TokenChoice(temperature=0.8)`` with
  ``logits`` unset: the reply (one message for the whole batch) carries the chosen
  token and its logprob, no logits.
- ``greedy``: ARGMAX logits, for reference (the token is the reply's argmax id).
- ``ahead``: the ``server`` choice, but after the prompt one DecodeSession step
  with ``max_new_tokens`` decodes the rest on the server, streaming each chosen
  token (no round trip per token).
- ``in_process``: the ``server`` choice step by step through the same model worker
  and executor in the benchmark's own process (no gRPC): the anchor for ``ahead``.

Throughput is output tokens per second end to end (prefill included) and
decode-only (the prefill call subtracted), each the median of ``--repeats`` runs.

Bytes on the wire are counted by a client interceptor on the benchmark's channel:
for every reply message (and request message) it adds the message's serialized
protobuf size (``ByteSize()``) plus gRPC's 5-byte length prefix. HTTP/2 frame
headers (9 bytes per DATA frame), HPACK'd headers and trailers, and TCP/IP are not
counted. Figures are per generated token: every reply of a run (the prefill reply
brings the first token) over batch x new tokens.  For ``server`` the record also
splits a decode-step result into its parts (chosen token, KV handle, timing, index).

    .venv/bin/python -m bench.token_choice [--batches 1 8 32] [--new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import functools
import logging
import platform
import statistics
import subprocess
import time

import grpc

from bench.common import log, served, write_results
from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.client.sampling import Sampler, SamplingParams
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.prepare import prepare_default_model
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.types import DecodeInput, LogitsPolicy, TokenChoice
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

TEMPERATURE = 0.8
VARIANTS = ("caller", "server", "greedy", "ahead", "in_process")
GRPC_PREFIX = 5  # a gRPC message's length prefix: 1 flag byte + 4 length bytes
TARGETS = {"server_vs_greedy": 0.95, "server_vs_caller": 1.15, "server_reply_bytes_per_token": 64,
           "ahead_vs_in_process_b1": 0.97}


class ByteCounter(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                  grpc.StreamStreamClientInterceptor):
    """Counts the serialized size of every request and reply message on a channel."""

    def __init__(self):
        self.reply_bytes = self.request_bytes = self.replies = 0
        self.last_batch_reply = None  # the last BatchDecode message seen (for the split)

    def _sent(self, request) -> None:
        self.request_bytes += request.ByteSize() + GRPC_PREFIX

    def _got(self, reply) -> None:
        self.reply_bytes += reply.ByteSize() + GRPC_PREFIX
        self.replies += 1

    def intercept_unary_unary(self, continuation, details, request):
        self._sent(request)
        outcome = continuation(details, request)
        if outcome.exception() is None:
            self._got(outcome.result())
        return outcome

    def intercept_unary_stream(self, continuation, details, request):
        self._sent(request)
        stream = continuation(details, request)
        method = details.method.decode() if isinstance(details.method, bytes) else details.method

        def counted():
            for reply in stream:
                self._got(reply)
                if method.endswith("/BatchDecode"):
                    self.last_batch_reply = reply
                yield reply

        return counted()

    def intercept_stream_stream(self, continuation, details, requests):
        def sent():
            for request in requests:
                self._sent(request)
                yield request

        stream = continuation(details, sent())

        class Counted:  # the call object the session reads from (iterable, cancellable)
            def __iter__(inner):
                return inner

            def __next__(inner):
                reply = next(stream)
                self._got(reply)
                return reply

            def cancel(inner):
                return stream.cancel()

        return Counted()

    def reset(self) -> None:
        self.reply_bytes = self.request_bytes = self.replies = 0


def counting_client(target: str) -> tuple[ExecutorClient, ByteCounter]:
    """An ExecutorClient whose stub runs over a counting interceptor."""
    client = ExecutorClient(target, timeout=600)
    counter = ByteCounter()
    client._stub = pb_grpc.ModelExecutorStub(grpc.intercept_channel(client._channel, counter))
    return client, counter


def prompts(batch: int, length: int) -> list[list[int]]:
    return [[1 + (7 * b + 13 * i) % 4000 for i in range(length)] for b in range(batch)]


def generate(client, variant: str, batch_prompts: list[list[int]], new_tokens: int,
             seed: int) -> tuple[float, float, list[list[int]]]:
    """One generation of ``new_tokens`` per prompt: (seconds, prefill seconds, tokens).
    ``client`` is a ModelWorker for ``in_process``, else an ExecutorClient."""
    n = len(batch_prompts)
    choices = [TokenChoice(temperature=TEMPERATURE, seed=seed + b) for b in range(n)]
    start = time.perf_counter()
    if variant == "caller":
        samplers = [Sampler(SamplingParams(temperature=TEMPERATURE, seed=seed + b)) for b in range(n)]
        outs = client.batch_prefill(batch_prompts, logits=LogitsPolicy.full())
        tokens = [s(o.logits) for s, o in zip(samplers, outs)]
    elif variant in ("server", "ahead"):
        outs = client.batch_prefill(batch_prompts, token_choice=choices)
        tokens = [o.chosen.token_id for o in outs]
    elif variant == "in_process":  # submitted together, as BatchPrefill does
        outs = [f.result() for f in [client.submit_prefill(p, None, None, choice=c)
                                     for p, c in zip(batch_prompts, choices)]]
        tokens = [o.chosen.token_id for o in outs]
    else:
        outs = client.batch_prefill(batch_prompts, logits=LogitsPolicy.argmax())
        tokens = [o.logits.argmax()[0] for o in outs]
    prefill_s = time.perf_counter() - start
    handles = [o.kv_cache for o in outs]
    generated = [[t] for t in tokens]
    if variant == "ahead":
        with client.decode_session() as session:
            run = session.decode_ahead([DecodeInput(t, h, c) for t, h, c in zip(tokens, handles, choices)],
                                       new_tokens - 1)
            for index, chosen in run:
                generated[index].append(chosen.token_id)
            handles = [r.kv_cache for r in run.results]
        tokens = []
    for _ in range(new_tokens - 1 if tokens else 0):
        if variant == "caller":
            steps = client.batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)],
                                        logits=LogitsPolicy.full())
            tokens = [s(o.logits) for s, o in zip(samplers, steps)]
        elif variant == "server":
            steps = client.batch_decode([DecodeInput(t, h, c) for t, h, c in zip(tokens, handles, choices)])
            tokens = [o.chosen.token_id for o in steps]
        elif variant == "in_process":
            steps = client.submit_decode([DecodeInput(t, h, c) for t, h, c in zip(tokens, handles, choices)],
                                         None).result()
            tokens = [o.chosen.token_id for o in steps]
        else:
            steps = client.batch_decode([DecodeInput(t, h) for t, h in zip(tokens, handles)],
                                        logits=LogitsPolicy.argmax())
            tokens = [o.logits.argmax()[0] for o in steps]
        handles = [o.kv_cache for o in steps]
        for g, t in zip(generated, tokens):
            g.append(t)
    elapsed = time.perf_counter() - start
    for h in handles:
        if variant == "in_process":
            client.submit(client.executor.release_cache, h.cache_id).result()
        else:
            client.release_cache(h.cache_id)
    return elapsed, prefill_s, generated


def result_split(reply) -> dict:
    """Bytes of one decode-step result of a single-reply BatchDecode, by field."""
    result = reply.results[-1] if reply.results else reply
    fields = {name: getattr(result, name).ByteSize() for name in ("chosen", "kv_cache", "timing")}
    fields["whole_result"] = result.ByteSize()  # with field tags, lengths and the index
    fields["results_per_message"] = max(len(reply.results), 1)
    fields["message"] = reply.ByteSize()
    return fields


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default="token_choice")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    records = []
    seen: dict = {}  # (batch, repeat) -> the tokens the server-side choice gave
    diverged: list = []  # per run: how many sequences chose other tokens than the first path's
    cpu = cpu_name()
    model_dir = str(prepare_default_model())
    config = ExecutorConfig(dtype=args.dtype, kv_tokens=32768)
    worker = ModelWorker(functools.partial(TorchExecutor.from_path, "bench", model_dir, config), "bench",
                         config.batch_wait_ms)  # in_process: loads on its own thread, as the server does
    worker.loaded.result()
    with served(model_dir, args.dtype) as target:
        client, counter = counting_client(target)
        for batch in args.batches:
            batch_prompts = prompts(batch, args.prompt_len)
            for variant in args.variants:
                runner = worker if variant == "in_process" else client
                generate(runner, variant, batch_prompts[:1], args.new_tokens, seed=0)  # warm-up
                runs, prefills, sizes = [], [], []
                for repeat in range(args.repeats):
                    counter.reset()
                    seconds, prefill_s, generated = generate(runner, variant, batch_prompts, args.new_tokens,
                                                             seed=1000 * repeat)
                    assert all(len(g) == args.new_tokens for g in generated)
                    if variant in ("server", "ahead", "in_process"):  # one seed, one path: the same tokens?
                        same = seen.setdefault((batch, repeat), generated)
                        differ = sum(a != b for a, b in zip(same, generated))
                        if differ:  # float32 logits of another batch shape can move a draw across a boundary
                            log.warning("%s batch %d: %d of %d sequences chose other tokens than the server's "
                                        "run with the same seeds", variant, batch, differ, batch)
                        diverged.append({"variant": variant, "batch": batch, "repeat": repeat,
                                         "sequences_differing": differ})
                    runs.append(seconds)
                    prefills.append(prefill_s)
                    sizes.append((counter.reply_bytes, counter.request_bytes, counter.replies))
                seconds, prefill_s = statistics.median(runs), statistics.median(prefills)
                out_tokens = batch * args.new_tokens
                reply_bytes, request_bytes, replies = sizes[-1]
                rec = {"variant": variant, "batch": batch, "dtype": args.dtype,
                       "tokens_per_s": round(out_tokens / seconds, 2),
                       "decode_tokens_per_s": round(batch * (args.new_tokens - 1) / (seconds - prefill_s), 2),
                       "seconds": [round(r, 4) for r in runs], "prefill_s": round(prefill_s, 4),
                       "reply_bytes_per_token": round(reply_bytes / out_tokens, 1),
                       "request_bytes_per_token": round(request_bytes / out_tokens, 1),
                       "reply_messages": replies, "new_tokens": args.new_tokens, "prompt_len": args.prompt_len,
                       "temperature": TEMPERATURE}
                if variant == "server" and counter.last_batch_reply is not None:
                    rec["decode_result_bytes"] = result_split(counter.last_batch_reply)
                records.append(rec)
                log.info("%-6s batch %3d: %8.1f tokens/s end to end, %8.1f decode-only, %10.1f reply B/token, "
                         "%6.1f request B/token", variant, batch, rec["tokens_per_s"], rec["decode_tokens_per_s"],
                         rec["reply_bytes_per_token"], rec["request_bytes_per_token"])
        client.close()
    worker.stop()
    ratios = compute_ratios(records)
    records.append({"ratios": ratios, "targets": TARGETS, "cpu": cpu, "same_seed_comparison": diverged})
    write_results(args.out, records)
    print(markdown(records, cpu, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))


def compute_ratios(records: list[dict]) -> dict:
    by = {(r["variant"], r["batch"]): r for r in records if "variant" in r}
    out = {}
    for batch in sorted({b for _, b in by}):
        c, s, g, a, p = (by.get((v, batch)) for v in VARIANTS)  # caller, server, greedy, ahead, in_process
        if s and g:
            out[f"server_vs_greedy_b{batch}"] = round(s["tokens_per_s"] / g["tokens_per_s"], 3)
        if a and g:
            out[f"ahead_vs_greedy_b{batch}"] = round(a["tokens_per_s"] / g["tokens_per_s"], 3)
        if s and c:
            out[f"server_vs_caller_b{batch}"] = round(s["tokens_per_s"] / c["tokens_per_s"], 3)
        if a and p:
            out[f"ahead_vs_in_process_b{batch}"] = round(a["tokens_per_s"] / p["tokens_per_s"], 3)
        if s and p:
            out[f"server_vs_in_process_b{batch}"] = round(s["tokens_per_s"] / p["tokens_per_s"], 3)
        for name, r in (("server", s), ("ahead", a)):
            if r:
                out[f"{name}_reply_bytes_per_token_b{batch}"] = r["reply_bytes_per_token"]
    return out


def markdown(records: list[dict], cpu: str, when: str) -> str:
    rows = [r for r in records if "variant" in r]
    names = {"caller": "caller-side sampling (FULL logits + client/sampling.py)",
             "server": "server-side choice (seeded TokenChoice, no logits), a call per step",
             "greedy": "greedy (ARGMAX logits), a call per step",
             "ahead": "server-side choice, decoding ahead (one DecodeSession step)",
             "in_process": "server-side choice, a step at a time in process (no gRPC)"}
    lines = [f"CPU: {cpu}; {when}; SmolLM2-135M {rows[0]['dtype']}, "
             f"prompt {rows[0]['prompt_len']}, {rows[0]['new_tokens']} new tokens, T={TEMPERATURE}",
             "",
             "| batch | variant | tokens/s | decode tokens/s | reply bytes/token | request bytes/token |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: (r["batch"], VARIANTS.index(r["variant"]))):
        lines.append(f"| {r['batch']} | {names[r['variant']]} | {r['tokens_per_s']:.1f} "
                     f"| {r['decode_tokens_per_s']:.1f} | {r['reply_bytes_per_token']:,.1f} "
                     f"| {r['request_bytes_per_token']:,.1f} |")
    ratios = compute_ratios(records)
    big = max(r["batch"] for r in rows)
    lines.append("")
    checks = [("server-side / greedy, both a call per step", f"server_vs_greedy_b{big}", ">=",
               TARGETS["server_vs_greedy"]),
              ("server-side decoding ahead / greedy a call per step", f"ahead_vs_greedy_b{big}", ">=",
               TARGETS["server_vs_greedy"]),
              ("server-side / caller-side", f"server_vs_caller_b{big}", ">=", TARGETS["server_vs_caller"]),
              ("reply bytes per sampled token, a call per step", f"server_reply_bytes_per_token_b{big}", "<=",
               TARGETS["server_reply_bytes_per_token"]),
              ("reply bytes per sampled token, decoding ahead", f"ahead_reply_bytes_per_token_b{big}", "<=",
               TARGETS["server_reply_bytes_per_token"]),
              ("decoding ahead through gRPC / in process", "ahead_vs_in_process_b1", ">=",
               TARGETS["ahead_vs_in_process_b1"])]
    for label, key, op, target in checks:
        if key in ratios:
            value = ratios[key]
            met = value >= target if op == ">=" else value <= target
            where = "batch 1" if key.endswith("_b1") else f"batch {big}"
            lines.append(f"- {label} at {where}: {value:g} (target {op} {target:g}: "
                         f"{'met' if met else 'missed'})")
    split = next((r.get("decode_result_bytes") for r in rows if r["variant"] == "server" and r["batch"] == big), None)
    if split:
        lines.append(f"- one server-side decode result, {split['whole_result']} bytes: chosen token "
                     f"{split['chosen']}, KV handle {split['kv_cache']}, timing {split['timing']} "
                     f"(+ tags and index); {split['results_per_message']} results in one message")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
