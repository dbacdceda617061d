"""``ferrum-rpc``: serve models, prepare the embedded default model, generate text."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger("ferrum_rpc.cli")


def _model_specs(values: list[str]):
    from ferrum_rpc.server.config import ModelSpec
    from ferrum_rpc.server.prepare import DEFAULT_MODEL_NAME, prepare_default_model

    if not values:
        return (ModelSpec(DEFAULT_MODEL_NAME, str(prepare_default_model())),)
    specs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = value.rstrip("/").rsplit("/", 1)[-1], value
        specs.append(ModelSpec(name, path))
    return tuple(specs)


def cmd_serve(args: argparse.Namespace) -> int:
    import torch

    from ferrum_rpc.server.app import serve
    from ferrum_rpc.server.config import MIB, ExecutorConfig, ServerConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    executor = ExecutorConfig(
        dtype=args.dtype, device=args.device, kv_tokens=args.kv_tokens, block_size=args.block_size,
        max_batch_size=args.max_batch, max_seq_len=args.max_seq_len,
        max_message_bytes=args.max_message_mb * MIB, batch_wait_ms=args.batch_wait_ms,
        kv_memory_fraction=args.kv_memory_fraction, idle_timeout_s=args.idle_timeout,
        prefill_chunk=args.prefill_chunk, prefix_caching=not args.no_prefix_cache,
        linear_kernel="aten" if args.no_packed_weights else args.linear_kernel, quantize=args.quantize,
        step_ops=args.step_ops, max_sequences=args.max_sequences,
        tenant_max_sequences=args.tenant_max_sequences, tenant_kv_tokens=args.tenant_kv_tokens,
    )
    try:
        config = _server_config(args, executor)
    except ValueError as exc:
        print(f"ferrum-rpc serve: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0


def _server_config(args: argparse.Namespace, executor):
    from ferrum_rpc.server.config import ServerConfig

    return ServerConfig(models=_model_specs(args.model), executor=executor, host=args.host,
                          port=args.port, grace_s=args.grace, warmup=not args.no_warmup,
                          tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                          auth_tokens=args.auth_tokens, insecure=args.insecure,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host)


def cmd_prepare(args: argparse.Namespace) -> int:
    from ferrum_rpc.server.prepare import prepare_default_model

    sys.stdout.write(f"{prepare_default_model(force=args.force)}\n")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from ferrum_rpc.client import ExecutorClient
    from ferrum_rpc.client.generate import encode_prompt, generate_ids, load_tokenizer, stream_text
    from ferrum_rpc.client.sampling import SamplingParams
    from ferrum_rpc.server.prepare import default_model_dir

    tokenizer = load_tokenizer(args.tokenizer or default_model_dir())
    params = SamplingParams(greedy=args.greedy, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed)
    prompt_ids = encode_prompt(tokenizer, args.prompt, chat=not args.raw)
    tls = None
    if args.tls_ca or args.tls_cert or args.tls_server_name:
        from ferrum_rpc.client import ClientTls

        tls = ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key, server_name=args.tls_server_name)
    token = os.environ.get("FERRUM_RPC_TOKEN") or None
    if args.token_file:
        token = Path(args.token_file).read_text().strip()
    with ExecutorClient(args.target, model=args.model, timeout=args.timeout, tls=tls, token=token) as client:
        info = client.info()
        stop = set(info.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
        if args.speculative:
            return _speculative(args, client, tokenizer, prompt_ids, stop)
        start = time.perf_counter()
        count = 0

        def counted():
            nonlocal count
            for token in generate_ids(client, prompt_ids, args.max_tokens, params, stop):
                count += 1
                yield token

        for delta in stream_text(tokenizer, counted(), stop):
            sys.stdout.write(delta)
            sys.stdout.flush()
        elapsed = time.perf_counter() - start
    sys.stdout.write("\n")
    sys.stdout.flush()
    log.info("%d prompt tokens, %d generated in %.2fs (%.1f tokens/s)", len(prompt_ids), count,
             elapsed, count / elapsed if elapsed else 0.0)
    return 0


def _speculative(args, client, tokenizer, prompt_ids: list[int], stop: set[int]) -> int:
    """Greedy speculative generation, then plain greedy for comparison: same tokens, fewer forwards."""
    from ferrum_rpc.client import ExecutorClient
    from ferrum_rpc.client.generate import generate_ids
    from ferrum_rpc.client.sampling import SamplingParams
    from ferrum_rpc.client.speculative import ModelDrafter, NgramDrafter, speculative_generate

    draft_client = ExecutorClient(args.target, model=args.draft_model, timeout=args.timeout) if args.draft_model else None
    drafter = ModelDrafter(draft_client) if draft_client else NgramDrafter()
    result = speculative_generate(client, prompt_ids, args.max_tokens, k=args.speculative,
                                  drafter=drafter, stop_ids=frozenset(stop))
    if draft_client:
        draft_client.close()
    text = tokenizer.decode([t for t in result.tokens if t not in stop], skip_special_tokens=True)
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    start = time.perf_counter()
    plain = list(generate_ids(client, prompt_ids, args.max_tokens, SamplingParams(greedy=True), stop))
    plain_s = time.perf_counter() - start
    log.info("speculative (k=%d, %s drafts): %d tokens in %.2fs, %d target forwards, acceptance %.0f%% "
             "(%d/%d); plain greedy %.2fs: speed-up %.2fx; outputs %s",
             args.speculative, args.draft_model or "n-gram", len(result.tokens), result.seconds,
             result.target_forwards, 100 * result.acceptance_rate, result.accepted, result.drafted,
             plain_s, plain_s / result.seconds, "identical" if plain == result.tokens else "DIFFER")
    return 0 if plain == result.tokens else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrum-rpc", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve models over gRPC")
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
    s.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (0: a free one, logged); off by default")
    s.add_argument("--metrics-host", default="127.0.0.1", help="address of the metrics endpoint")
    s.add_argument("--max-sequences", type=int, default=10_000,
                   help="live sequences in all, forks included (0: no cap)")
    s.add_argument("--tenant-max-sequences", type=int, default=0, help="live sequences per tenant (0: no cap)")
    s.add_argument("--tenant-kv-tokens", type=int, default=0, help="KV tokens one tenant may hold (0: no quota)")
    s.add_argument("--port", type=int, default=50051, help="0 picks a free port (logged)")
    s.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    s.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    s.add_argument("--kv-tokens", type=int, default=16384, help="KV pool capacity in tokens")
    s.add_argument("--kv-memory-fraction", type=float, default=0.0,
                   help="size the KV pool to this fraction of available device memory (overrides --kv-tokens)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    s.add_argument("--idle-timeout", type=float, default=600.0,
                   help="reclaim sequences idle this many seconds (0: never); later calls get CACHE_EXPIRED")
    s.add_argument("--prefill-chunk", type=int, default=256,
                   help="run longer prompts in chunks of this many tokens, interleaved with decodes")
    s.add_argument("--no-prefix-cache", action="store_true", help="do not share prompt blocks across requests")
    s.add_argument("--linear-kernel", default="auto", choices=["auto", "onednn-packed", "aten"],
                   help="auto: probe this CPU for oneDNN prepacked linears and fall back to plain F.linear; "
                        "aten: always the fallback; onednn-packed: fail at load if it cannot run here")
    s.add_argument("--no-packed-weights", action="store_true",
                   help="same as --linear-kernel aten (saves memory: packed float32 weights are held twice)")
    s.add_argument("--quantize", default="none", choices=["none", "int8", "int4"],
                   help="weight-only quantization of the linear layers (CPU): int8 per channel, or int4 in "
                        "groups of 32 with scale and minimum (GGUF Q4_1's layout; the LM head stays int8)")
    s.add_argument("--step-ops", default="auto", choices=["auto", "fused", "eager"],
                   help="auto: fused C++ ops for RMSNorm, the MLP activation and decode attention where they "
                        "build and agree with torch here (CPU); eager: torch ops only; fused: fail if they cannot")
    s.add_argument("--max-batch", type=int, default=64, help="most sequences per forward")
    s.add_argument("--max-seq-len", type=int, default=0, help="0: the model's maximum")
    s.add_argument("--max-message-mb", type=int, default=256, help="largest reply (MiB)")
    s.add_argument("--batch-wait-ms", type=float, default=0.0, help="wait for more decodes to batch")
    s.add_argument("--grace", type=float, default=30.0, help="seconds in-flight calls get on SIGTERM")
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    s.add_argument("--no-warmup", action="store_true")
    s.set_defaults(func=cmd_serve)

    p = sub.add_parser("prepare", help="convert the embedded default model once; prints its folder")
    p.add_argument("--force", action="store_true", help="convert again even if cached")
    p.set_defaults(func=cmd_prepare)

    g = sub.add_parser("generate", help="generate text through a running server")
    g.add_argument("prompt")
    g.add_argument("--target", default="127.0.0.1:50051")
    g.add_argument("--model", default="", help="hosted model name (default: the server's)")
    g.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the embedded model's)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--greedy", action="store_true")
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=50)
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--seed", type=int, default=None)
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
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
