"""``ferrum-rpc serve`` and ``ferrum-rpc prepare``: the server side of the CLI
(needs the ``server`` extra; ``prepare`` also the ``text`` extra)."""

from __future__ import annotations

import argparse
import asyncio
import sys


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
        prefill_chunk=args.prefill_chunk, step_token_budget=args.step_token_budget,
        prefix_caching=not args.no_prefix_cache,
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
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          shared_memory=args.shared_memory, port_file=args.port_file,
                          admin_tenants=tuple(t for t in args.admin_tenants.split(",") if t),
                          push_allow=args.push_allow, push_ca=args.push_ca, export_grace_s=args.export_grace)


def cmd_prepare(args: argparse.Namespace) -> int:
    from ferrum_rpc.server.prepare import prepare_default_model

    sys.stdout.write(f"{prepare_default_model(force=args.force)}\n")
    return 0
