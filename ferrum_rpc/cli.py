"""``ferrum-rpc``: serve models, prepare the embedded default model, generate text.

This module holds only the argument parser: each command's code is imported
when it runs, from ``ferrum_rpc.server.cli`` (serve, prepare) or
``ferrum_rpc.client.cli`` (generate), so the client side never imports server
code and a client-only install can generate against a remote server.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from ferrum_rpc.errors import StartupError

EXTRA_FOR = {"serve": "server", "prepare": "server,text", "generate": "text"}


def _command(module: str, name: str):
    """A command function imported on use; a missing extra becomes a one-line hint,
    and so does a server that cannot start as configured (:class:`StartupError`,
    exit status 2, no traceback)."""
    def run(args: argparse.Namespace) -> int:
        try:
            func = getattr(importlib.import_module(module), name)
            return func(args)
        except StartupError as exc:
            message = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            print(f"ferrum-rpc {args.command}: {message}", file=sys.stderr)
            return 2
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0] in ("torch", "safetensors", "transformers", "gguf", "tokenizers",
                                                       "jinja2", "prometheus_client", "grpc_health",
                                                       "grpc_reflection"):
                print(f"ferrum-rpc {args.command}: {exc.name} is not installed; "
                      f"pip install 'ferrum-rpc[{EXTRA_FOR[args.command]}]'", file=sys.stderr)
                return 2
            raise
    return run


def _one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Usage errors as one line on stderr (exit status 2), not the usage text and then the error."""
    def error(message: str):
        parser.exit(2, f"{parser.prog}: {message} (see {parser.prog} --help)\n")
    parser.error = error
    return parser


def _lora(value: str) -> tuple[str, str]:
    name, sep, path = value.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {value!r}")
    return name, path


def _non_negative_int(value: str) -> int:
    number = int(value)
    if number < 0:
        raise ValueError(value)
    return number


def _port(value: str) -> int:
    number = int(value)
    if not 0 <= number <= 65535:
        raise ValueError(value)
    return number


_non_negative_int.__name__ = "non-negative integer"  # argparse's "invalid <name> value: '-1'"
_port.__name__ = "port (0..65535)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrum-rpc", description="Serve models over gRPC, prepare the "
                                     "embedded default model, generate text through a server.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    _one_line_errors(parser)
    sub = parser.add_subparsers(dest="command", required=True)
    parser.commands = sub.choices  # each command's parser, by name

    s = _one_line_errors(sub.add_parser("serve", help="serve models over gRPC"))
    s.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH",
                   help="HF-style folder (config.json + *.safetensors); repeatable. "
                        "Default: the embedded SmolLM2-135M-Instruct, prepared on first use")
    s.add_argument("--host", default="127.0.0.1",
                   help="bind address; anything but loopback needs --tls-cert/--tls-key and --auth-tokens, "
                        "or --insecure")
    s.add_argument("--tls-cert", default="", help="PEM certificate chain: serve TLS only")
    s.add_argument("--tls-key", default="", help="PEM private key of --tls-cert")
    s.add_argument("--tls-client-ca", default="", help="PEM CA bundle: require and verify client certificates")
    s.add_argument("--auth-tokens", default="",
                   help="file of '<tenant> <token>' lines: every call but health checks needs "
                        "'authorization: Bearer <token>'; sequences are private to their tenant")
    s.add_argument("--insecure", action="store_true",
                   help="allow a non-loopback --host without TLS and tokens (a trusted network only)")
    s.add_argument("--metrics-port", type=_port, default=None,
                   help="serve Prometheus metrics on this port (0: a free one, logged); off by default")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.add_argument("--admin-tenants", default="",
                   help="comma-separated tenants (of --auth-tokens) that may load and unload models")
    s.add_argument("--shared-memory", default="auto", choices=["auto", "on", "off"],
                   help="RegisterSharedMemory (full logits into a caller's POSIX shared memory): auto serves it "
                        "on a loopback --host only, where every caller is on this machine")
    s.add_argument("--max-sequences", type=int, default=10_000,
                   help="live sequences in all, forks included (0: no cap)")
    s.add_argument("--tenant-max-sequences", type=_non_negative_int, default=None,
                   help="live sequences one tenant may hold (default: half of --max-sequences for each tenant of "
                        "--auth-tokens, no cap without tokens; a number binds every caller; 0: no cap)")
    s.add_argument("--tenant-kv-tokens", type=_non_negative_int, default=None,
                   help="KV tokens one tenant may hold (default: half of the KV pool for each tenant of "
                        "--auth-tokens, no quota without tokens; a number binds every caller; 0: no quota)")
    s.add_argument("--tenant-ahead-sequences", type=_non_negative_int, default=None,
                   help="sequences one tenant may have decoding ahead at once, over all its DecodeSession "
                        "steps (default: a quarter of --max-batch for each tenant of --auth-tokens, no cap "
                        "without tokens; a number binds every caller; 0: no cap)")
    s.add_argument("--port", type=_port, default=50051, help="0 picks a free port (logged)")
    s.add_argument("--port-file", default="", metavar="PATH",
                   help="once listening, write PATH (atomically) as JSON: address, port, instance_id, pid and "
                        "state (listening, then serving once every model serves); removed on exit")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "bfloat16", "int8"],
                   help="the KV pool's dtype.  bfloat16 under --dtype float32 (any --quantize) halves the "
                        "pool's bytes and what a long context's attention reads, each key and value rounded once "
                        "as it is written; int8 (either --dtype) stores each token's key and value per kv head "
                        "as int8 with a float16 scale per block of 32 values (absmax / 127 of that block alone, "
                        "llama.cpp's q8_0: ~1.06 bytes a value, 3.75x the tokens of float32 in the same bytes); "
                        "auto (the default): bfloat16 with "
                        "--quantize w8a8 or w4a8, else --dtype")
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    s.add_argument("--kv-tokens", type=int, default=16384, help="KV pool capacity in tokens")
    s.add_argument("--kv-memory-fraction", type=float, default=0.0,
                   help="size the KV pool to this fraction of available device memory (overrides --kv-tokens)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    s.add_argument("--idle-timeout", type=float, default=600.0,
                   help="reclaim sequences idle this many seconds (0: never); later calls get CACHE_EXPIRED")
    s.add_argument("--prefill-chunk", type=int, default=256,
                   help="run longer prompts in chunks of this many tokens, interleaved with decodes")
    s.add_argument("--step-token-budget", type=int, default=128,
                   help="most tokens in one forward while decodes wait: decodes first, then parts of prompts "
                        "(the unified forward); 0: prompts and decodes alternate in separate forwards")
    s.add_argument("--no-prefix-cache", action="store_true", help="do not share prompt blocks across requests")
    s.add_argument("--linear-kernel", default="auto", choices=["auto", "onednn-packed", "aten"],
                   help="auto: probe this CPU for oneDNN prepacked linears and fall back to plain F.linear; "
                        "aten: always the fallback; onednn-packed: fail at load if it cannot run here")
    s.add_argument("--no-packed-weights", action="store_true",
                   help="same as --linear-kernel aten (saves memory: packed float32 weights are held twice)")
    s.add_argument("--quantize", default="none", choices=["none", "int8", "int4", "w8a8", "w4a8"],
                   help="quantized linear layers (CPU): int8 or int4 weights in groups of 32 with scale "
                        "and minimum (GGUF Q4_1's layout; the LM head stays int8), multiplied in integers with "
                        "activations as two int8 digits per block (about 15 bits); w8a8 and w4a8: the same "
                        "weights, activations as one int8 digit per block of 32 (llama.cpp's Q8_1), faster")
    s.add_argument("--step-ops", default="auto", choices=["auto", "fused", "eager"],
                   help="auto: fused C++ ops for RMSNorm, the MLP activation and decode attention where they "
                        "build and agree with torch here (CPU); eager: torch ops only; fused: fail if they cannot")
    s.add_argument("--cuda-graphs", default="auto", choices=["auto", "off"],
                   help="auto: on a CUDA device, replay each plain decode step as a captured CUDA graph (one "
                        "launch a step); off: run every step eagerly")
    s.add_argument("--batch-invariant", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="a token's logits bit-identical whatever shares its forward, however its prompt was "
                        "chunked or cached; auto (the default): wherever the model, dtype and kernels allow it "
                        "(float32/bfloat16, any --quantize, CPU fused ops, --linear-kernel auto; GetCapabilities "
                        "says which); on (or the bare flag): refuse to start where they do not; off: the "
                        "per-shape kernels (see docs/server.md)")
    s.add_argument("--lora", action="append", default=[], metavar="NAME=PATH", type=_lora,
                   help="load the PEFT LoRA adapter folder PATH as NAME at start-up (repeatable); new sequences "
                        "name it (Prefill's adapter); LoadAdapter adds more at run time")
    s.add_argument("--adapter-root", default="", metavar="DIR",
                   help="LoadAdapter (and --lora) read adapters only from folders inside DIR, checked after "
                        "following symbolic links; without it an admin may load from any folder the server "
                        "can read")
    s.add_argument("--max-adapters", type=_non_negative_int, default=8,
                   help="LoRA adapters loaded at once; past it the least recently used idle one is evicted "
                        "(0: none served)")
    s.add_argument("--max-lora-rank", type=int, default=64, help="the largest LoRA rank an adapter may have")
    s.add_argument("--adapter-memory-mb", type=_non_negative_int, default=0,
                   help="MiB the adapters' weights may take in all (0: no cap besides --max-adapters)")
    s.add_argument("--max-batch", type=int, default=64, help="most sequences per forward")
    s.add_argument("--max-seq-len", type=int, default=0, help="0: the model's maximum")
    s.add_argument("--max-message-mb", type=int, default=256, help="largest reply (MiB)")
    s.add_argument("--batch-wait-ms", type=float, default=0.0, help="wait for more decodes to batch")
    s.add_argument("--grace", type=float, default=30.0, help="seconds in-flight calls get on SIGTERM")
    s.add_argument("--push-allow", default="loopback", metavar="NETWORKS",
                   help="where PushSequence may connect (the caller names the address): comma-separated CIDR "
                        "networks or addresses, 'loopback' (the default), 'none'")
    s.add_argument("--push-ca", default="",
                   help="PEM CA bundle receivers' certificates must chain to when pushing over TLS "
                        "(default: the system roots; pushes use TLS when this server does)")
    s.add_argument("--export-grace", type=float, default=0.0,
                   help="on SIGTERM, seconds the server keeps answering ExportSequence/PushSequence for its "
                        "live sequences (so callers move them instead of recomputing), at most 300; 0: none")
    s.add_argument("--transfer-budget-mb", type=float, default=0.0, metavar="MIB",
                   help="KV bytes all imports in flight may buffer at once, MiB (0: the largest KV pool's size)")
    s.add_argument("--import-idle-timeout", type=float, default=30.0, metavar="S",
                   help="end an import stream that sends nothing for this long (its buffer is freed)")
    s.add_argument("--push-timeout", type=float, default=60.0, metavar="S",
                   help="deadline of a push to its receiver when the PushSequence caller set none")
    s.add_argument("--threads", type=_non_negative_int, default=0,
                   help="torch intra-op threads (0: torch's default)")
    s.add_argument("--no-warmup", action="store_true",
                   help="serve without the warm-up (one prefill and decode per model, and the decode "
                        "crossover behind Capabilities.optimal_batch_size, which stays 0)")
    s.add_argument("--remeasure", action="store_true",
                   help="time the decode crossover again at start, instead of reading the result stored "
                        "under the cache folder for this model, dtype, kernels, CPU, torch and thread count")
    s.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                   help="split the model over N ranks (torch.distributed: gloo on CPU, NCCL on CUDA); "
                        "without --tp-master, N local rank processes on this machine")
    s.add_argument("--tensor-parallel-timeout", type=float, default=30.0, metavar="S",
                   help="a forward waiting this long for the other ranks fails the server closed")
    s.add_argument("--tp-master", default="", metavar="HOST:PORT",
                   help="join ranks across machines at rank 0's rendezvous address (default: "
                        "$MASTER_ADDR:$MASTER_PORT as torchrun sets them, else a local launch)")
    s.add_argument("--tp-rank", type=int, default=None, metavar="R",
                   help="this process's rank with --tp-master (default: $RANK; rank 0 serves gRPC)")
    s.set_defaults(func=_command("ferrum_rpc.server.cli", "cmd_serve"))

    p = _one_line_errors(sub.add_parser("prepare",
                                        help="convert the embedded default model once; prints its folder"))
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=_command("ferrum_rpc.server.cli", "cmd_prepare"))

    g = _one_line_errors(sub.add_parser("generate", help="generate text through a running server"))
    g.add_argument("prompt")
    g.add_argument("--target", action="append", default=None, metavar="HOST:PORT",
                   help="server address (default 127.0.0.1:50051); repeat it, or give gRPC's "
                        "'ipv4:a:p,b:p' / 'dns:///host:port' forms, for several replicas (placement, "
                        "affinity, failover by replay)")
    g.add_argument("--model", default="", help="hosted model name (default: the server's)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--greedy", action="store_true")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=None,
                   help="the same seed gives the same tokens on every run (default: fresh randomness)")
    g.add_argument("--caller-side", action="store_true",
                   help="sample here from logits the server returns, instead of the server choosing each "
                        "token (the default where the server offers token choice: no logits on the wire)")
    g.add_argument("--timeout", type=float, default=60.0, help="per-call deadline (s)")
    g.add_argument("--tls-ca", default="", help="PEM CA bundle to verify the server with (TLS)")
    g.add_argument("--tls-cert", default="", help="PEM client certificate (servers that require mTLS)")
    g.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    g.add_argument("--tls-server-name", default="", help="name to verify in the server's certificate")
    g.add_argument("--token-file", default="",
                   help="file holding the bearer token (or set FERRUM_RPC_TOKEN); never on the command line")
    g.add_argument("--speculative", type=int, default=0, metavar="K",
                   help="greedy speculative decoding drafting K tokens a round; reports acceptance and "
                        "speed-up over plain greedy decoding")
    g.add_argument("--draft-model", default="", help="draft with this hosted model instead of n-gram lookup")
    g.set_defaults(func=_command("ferrum_rpc.client.cli", "cmd_generate"))
    return parser


def flags_markdown(command: str) -> str:
    """A command's flags as a markdown table (flag, default, what it does), built from its
    parser: the docs' flag reference (docs/server.md), which a test keeps equal to it."""
    parser = build_parser().commands[command]
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "--help" in action.option_strings:
            continue
        flag = ", ".join(f"`{o}{' ' + action.metavar if action.metavar else ''}`" for o in action.option_strings)
        default = "" if action.default in (None, False, [], "", argparse.SUPPRESS) else f"`{action.default}`"
        rows.append(f"| {flag} | {default} | {' '.join((action.help or '').split()).replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # told by the command's own parser, which names its own --help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    if sys.argv[1:2] == ["--flags-markdown"]:  # regenerates docs/server.md's flag table
        sys.stdout.write(flags_markdown(sys.argv[2]))
        sys.exit(0)
    sys.exit(main())
