"""A tensor-parallel rank other than 0, as a process: it loads its shard of the model
and of the KV pool, then runs every plan rank 0 broadcasts until told to stop."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal

import torch

from .engine.forward import forward
from .kv.pool import KV_TORCH_DTYPES, KvPool
from .models import TORCH_DTYPES, load_model
from .parallel.group import Group, join
from .parallel.runner import follow_update, receive
from .parallel.shard import Shard

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    """Linux: SIGKILL this process when the process that spawned it ends, however it ends."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent and os.getppid() != parent:  # the parent went before prctl took effect
        os._exit(1)


def rank_main(group: Group, model_path: str, executor_config, log_level: int = logging.INFO,
              parent: int = 0, threads: int = 0) -> None:
    """A rank other than 0: loads its shard, then runs every plan rank 0 sends until "stop".
    Any failure exits non-zero (rank 0 sees it and fails closed)."""
    if parent:
        _die_with_parent(parent)
    logging.basicConfig(level=log_level, format=f"%(asctime)s rank{group.rank} %(name)s %(levelname)s %(message)s")
    if threads:
        torch.set_num_threads(threads)
    try:
        join(group, executor_config.device)
        serve_rank(group, model_path, executor_config)
    except BaseException:
        log.exception("rank %d failed", group.rank)
        os._exit(1)
    os._exit(0)


def serve_rank(group: Group, model_path: str, executor_config) -> None:
    device = group.device(executor_config.device)
    model = load_model(model_path, TORCH_DTYPES[executor_config.dtype], device, executor_config.linear_kernel,
                       executor_config.quantize, executor_config.step_ops,
                       shard=Shard.of_model(group.rank, group.degree, model_path),
                       batch_invariant=executor_config.batch_invariant)
    shard: Shard = model.tp
    kind, num_blocks, block_size = receive(device)  # the pool rank 0 sized
    assert kind == "pool", kind
    cfg = shard.local_config()
    pool = KvPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                  KV_TORCH_DTYPES[executor_config.kv_dtype_name], device)
    log.info("rank %d serving its shard: KV pool of %d blocks (%.1f MiB)", group.rank, num_blocks,
             pool.nbytes / 2**20)
    while True:
        message = receive(device)
        if message[0] == "forward":
            _, steps, top, requests = message
            local = forward(model, pool, steps)
            shard.reduce_logits(local, top)
            if requests:
                shard.choose(local, requests)
        elif message[0] == "update":  # UpdateWeights: this rank's slices of the new tensors
            model = follow_update(message[1], model, lambda tensors: load_model(
                model_path, TORCH_DTYPES[executor_config.dtype], device, executor_config.linear_kernel,
                executor_config.quantize, executor_config.step_ops, shard=shard,
                batch_invariant=executor_config.batch_invariant, overrides=tensors), device)
        elif message[0] == "copy":
            pool.copy_blocks(message[1])
        elif message[0] == "stop":
            log.info("rank %d: stopping", group.rank)
            return
        else:
            raise RuntimeError(f"unknown plan {message[0]!r}")


