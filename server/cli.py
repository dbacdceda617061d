"""``ferrum-rpc serve`` and ``ferrum-rpc prepare``: the server side of the CLI
(needs the ``server`` extra; ``prepare`` also the ``text`` extra)."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import sys


# The modules each command imports whatever its options (serve's metrics add
# prometheus_client).  They are looked up, not imported, before the command reads a
# file or resolves the default model, so that an install without the command's extra
# gets ferrum_rpc.cli's one-line hint naming it, and not an error about a step after.
SERVE_NEEDS = ("torch", "safetensors", "grpc_health", "grpc_reflection")
PREPARE_NEEDS = ("torch", "safetensors", "transformers", "gguf")


def require(modules) -> None:
    """Raises ``ModuleNotFoundError`` (its ``name`` set) for the first of ``modules`` not installed."""
    for name in modules:
        if importlib.util.find_spec(name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)


def _model_specs(values: list[str]):
    from .config import ModelSpec
    from .prepare import DEFAULT_MODEL_NAME, prepare_default_model

    if not values:
        try:
            return (ModelSpec(DEFAULT_MODEL_NAME, str(prepare_default_model())),)
        except FileNotFoundError as exc:  # the embedded model's package is not installed
            from ferrum_rpc.errors import StartupError

            raise StartupError(f"no --model given and the default model cannot be prepared: {exc}") from None
    specs = []
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            name, path = value.rstrip("/").rsplit("/", 1)[-1], value
        specs.append(ModelSpec(name, path))
    return tuple(specs)


# libgomp's threads spin for GOMP_SPINCOUNT pauses (300,000 by default: milliseconds)
# after each parallel region before they sleep.  Spinning that long between two
# BatchDecode calls takes the cores the gRPC thread and the caller need; sleeping
# at once makes every forward of a batch-1 run start by waking a thread on a halted
# core, since the Python between two forwards outlasts a short spin.  50,000 pauses
# (about a millisecond) outlast that Python and still sleep soon after the last call
# (docs/performance.md has the measurements).
OPENMP_SPIN_COUNT = "50000"


def openmp_spin() -> str | None:
    """Sets GOMP_SPINCOUNT for this process unless the user chose a spin count or a
    wait policy, or OpenMP is loaded already (too late to matter); returns what it set."""
    if "torch" in sys.modules or {"GOMP_SPINCOUNT", "OMP_WAIT_POLICY"} & os.environ.keys():
        return None
    os.environ["GOMP_SPINCOUNT"] = OPENMP_SPIN_COUNT
    return OPENMP_SPIN_COUNT


def cmd_serve(args: argparse.Namespace) -> int:
    require(SERVE_NEEDS + (("prometheus_client",) if args.metrics_port is not None else ()))
    spin = openmp_spin()
    from .config import MIB, ExecutorConfig
    from .preflight import preflight

    executor = ExecutorConfig(
        dtype=args.dtype, kv_dtype=args.kv_dtype, device=args.device, kv_tokens=args.kv_tokens, block_size=args.block_size,
        max_batch_size=args.max_batch, max_seq_len=args.max_seq_len,
        max_message_bytes=args.max_message_mb * MIB, batch_wait_ms=args.batch_wait_ms,
        kv_memory_fraction=args.kv_memory_fraction, idle_timeout_s=args.idle_timeout,
        prefill_chunk=args.prefill_chunk, step_token_budget=args.step_token_budget,
        prefix_caching=not args.no_prefix_cache,
        linear_kernel="aten" if args.no_packed_weights else args.linear_kernel, quantize=args.quantize,
        step_ops=args.step_ops, cuda_graphs=args.cuda_graphs, batch_invariant=args.batch_invariant,
        max_sequences=args.max_sequences,
        tenant_max_sequences=args.tenant_max_sequences, tenant_kv_tokens=args.tenant_kv_tokens,
        tenant_ahead_sequences=args.tenant_ahead_sequences,
        tensor_parallel=args.tensor_parallel, tensor_parallel_timeout_s=args.tensor_parallel_timeout,
        max_adapters=args.max_adapters, max_lora_rank=args.max_lora_rank,
        adapter_memory_mb=args.adapter_memory_mb, loras=tuple(args.lora), adapter_root=args.adapter_root,
    )
    try:
        config = _server_config(args, executor)
    except ValueError as exc:
        print(f"ferrum-rpc serve: {exc}", file=sys.stderr)
        return 2
    preflight(config)  # the files and folders, before torch loads: a misconfiguration fails at once
    import torch

    from .app import serve

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.tensor_parallel > 1:
        return _serve_tensor_parallel(args, config)
    if spin:  # after the checks: a misconfiguration stays one line
        logging.getLogger(__name__).info("OpenMP threads spin %s pauses before sleeping (GOMP_SPINCOUNT; "
                                         "set it or OMP_WAIT_POLICY to choose)", spin)
    asyncio.run(serve(config))
    return 0


def _serve_tensor_parallel(args: argparse.Namespace, config) -> int:
    """``--tensor-parallel N``: rank 0 serves gRPC over the group; another rank (with
    --tp-master) serves rank 0's plans.  A lost rank exits 3, after the server has
    failed its calls (see ``App.fail_closed``)."""
    from ferrum_rpc.errors import RankLost, StartupError
    from .app import serve
    from .parallel import group as tp
    from .parallel.shard import check_divisible
    from .rank import rank_main
    from .models.config import ModelConfig

    degree = args.tensor_parallel
    if len(config.models) != 1:
        raise StartupError(f"--tensor-parallel serves one model; {len(config.models)} --model given")
    path = config.models[0].path
    try:
        check_divisible(ModelConfig.from_dir(path), degree)
    except (OSError, ValueError, KeyError) as exc:
        if isinstance(exc, StartupError):
            raise
        raise StartupError(f"--model {path}: cannot read its config.json: {exc}") from None
    master = args.tp_master or (f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
                                if "MASTER_ADDR" in os.environ and "MASTER_PORT" in os.environ else "")
    rank = args.tp_rank if args.tp_rank is not None else int(os.environ.get("RANK", 0)) if master else 0
    if not 0 <= rank < degree:
        raise StartupError(f"--tp-rank {rank} is outside 0..{degree - 1}")
    group = tp.Group(rank, degree, master or f"127.0.0.1:{tp.free_port()}", config.executor.tensor_parallel_timeout_s)
    threads = args.threads
    if not master and not threads and config.executor.device.startswith("cpu"):
        threads = max(1, (os.cpu_count() or 1) // degree)  # the ranks share this machine's cores
        import torch

        torch.set_num_threads(threads)
    if rank != 0:
        rank_main(group, path, config.executor, logging.getLogger().level, threads=threads)
        return 0  # rank_main exits the process itself
    if master:
        tp.join(group, config.executor.device)
        tp.start_remote_watchdog(group)
    else:
        tp.launch_local(group, rank_main, path, config.executor, threads)
    try:
        asyncio.run(serve(config))
    except RankLost as exc:
        logging.getLogger(__name__).error("exiting: %s", exc.message)
        logging.shutdown()
        os._exit(3)  # the worker may be stuck in a collective: no thread is waited for
    tp.shutdown()
    return 0


def _server_config(args: argparse.Namespace, executor):
    from .config import MIB, ServerConfig

    return ServerConfig(models=_model_specs(args.model), executor=executor, host=args.host,
                          port=args.port, grace_s=args.grace, warmup=not args.no_warmup,
                          remeasure=args.remeasure,
                          tls_cert=args.tls_cert, tls_key=args.tls_key, tls_client_ca=args.tls_client_ca,
                          auth_tokens=args.auth_tokens, insecure=args.insecure,
                          metrics_port=args.metrics_port, metrics_host=args.metrics_host,
                          shared_memory=args.shared_memory, port_file=args.port_file,
                          admin_tenants=tuple(t for t in args.admin_tenants.split(",") if t),
                          push_allow=args.push_allow, push_ca=args.push_ca, export_grace_s=args.export_grace,
                          transfer_budget_bytes=int(args.transfer_budget_mb * MIB),
                          import_idle_timeout_s=args.import_idle_timeout, push_timeout_s=args.push_timeout)


def cmd_prepare(args: argparse.Namespace) -> int:
    require(PREPARE_NEEDS)
    from .prepare import prepare_default_model

    sys.stdout.write(f"{prepare_default_model(force=args.force)}\n")
    return 0
