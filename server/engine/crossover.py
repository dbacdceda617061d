"""The decode crossover (:func:`measure_optimal_batch`), kept across restarts.

Timing a decode step at batch 1, 2, 4, ... 64 takes most of a start on a small CPU
(seconds to tens of seconds), and gives the same answer while nothing it depends on
changes.  Its result is stored under ``cache_root()/crossover/``, one small JSON file
per key: the model's weights digest, the serving dtype, KV dtype, quantization and
the kernels chosen (linear path, step ops, batch invariance), the device, the CPU
(model name, flags, the ISA torch dispatches to), torch's version and thread count,
and the limits that decide which batch sizes are timed.  Any change gives a new key,
so the pass runs again; ``remeasure`` runs it regardless and stores the new result.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.paths import cache_root
from ferrum_rpc.types import DecodeInput, LogitsPolicy
from ..kernels.select import cpu_capability, cpu_identity

if TYPE_CHECKING:
    from .executor import TorchExecutor

log = logging.getLogger(__name__)

VERSION = 1  # of the measurement: a change to how it measures gives new keys


def crossover_key(executor) -> dict:
    """Everything the measured crossover depends on."""
    config, kv = executor.config, executor.kv
    return {
        "version": VERSION,
        "weights": executor.weights.digest,
        "dtype": str(executor.dtype), "kv_dtype": config.kv_dtype_name, "quantize": config.quantize,
        "kernels": executor.model.kernels.describe(), "batch_invariant": config.batch_invariant,
        "device": str(executor.device), "cpu": cpu_identity(), "cpu_capability": cpu_capability(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "block_size": kv.block_size, "kv_blocks": kv.num_blocks, "max_batch_size": config.max_batch_size,
        "max_sequences": config.max_sequences, "tenant_max_sequences": executor.bounds("").max_sequences,
    }


def cache_file(key: dict) -> Path:
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return cache_root() / "crossover" / f"{digest}.json"


def optimal_batch(executor, remeasure: bool = False) -> int:
    """The executor's decode crossover: the stored one for its key, else (or with
    ``remeasure``) measured now and stored.  Sets ``executor.optimal_batch_size``."""
    key = crossover_key(executor)
    path = cache_file(key)
    if not remeasure:
        try:
            stored = json.loads(path.read_text())
            if stored.get("key") == key and isinstance(stored.get("optimal_batch_size"), int):
                executor.optimal_batch_size = stored["optimal_batch_size"]
                log.info("%s: decode crossover at batch %d (stored in %s; --remeasure to time it again)",
                         executor.name, executor.optimal_batch_size, path)
                return executor.optimal_batch_size
        except (OSError, ValueError):
            pass  # none stored, or unreadable: measure
    best = measure_optimal_batch(executor)
    if best:  # 0: not measured (a pool too small): nothing worth keeping
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"key": key, "optimal_batch_size": best}, indent=1))
            os.replace(tmp, path)  # whole or absent, for a concurrent start reading it
        except OSError as exc:
            log.warning("%s: decode crossover not stored: %s", executor.name, exc)
    return best


def measure_optimal_batch(ex: TorchExecutor, repeats: int = 3) -> int:
    """The decode crossover: times one decode step at batch 1, 2, 4, ... (as far as
    the batch limit and the pool allow) and returns the batch past which doubling
    raises throughput by less than 10%.  Uses (and releases) sequences of its own;
    the statistics do not count its forwards."""
    sizes, block = [1], ex.kv.block_size
    room = ex.kv.num_free // -(-(block + repeats * 7) // block)  # blocks one sequence may reach
    limit = min(ex.config.max_batch_size, room, 64, ex.config.max_sequences or 64,
                ex.bounds("").max_sequences or 64)
    while sizes[-1] * 2 <= limit:
        sizes.append(sizes[-1] * 2)
    handles, best, step_s = [], sizes[0], {}
    with ex.stats.not_counted():
        try:
            for _ in range(sizes[-1]):
                handles.append(ex.prefill([0] * block, None, LogitsPolicy.argmax()).kv_cache)
            for size in sizes:
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    outs = ex.batch_decode([DecodeInput(0, h) for h in handles[:size]], LogitsPolicy.argmax())
                    times.append(time.perf_counter() - t0)
                    handles[:size] = [o.kv_cache for o in outs]
                step_s[size] = sorted(times)[len(times) // 2]
                if size > 1 and (size / step_s[size]) < 1.1 * (size // 2 / step_s[size // 2]):
                    break
                best = size
        except ExecutorError as exc:  # a pool or caps too small to measure: say so, serve anyway
            log.warning("%s: decode crossover not measured: %s", ex.name, exc)
            return 0
        finally:
            for h in handles:
                ex.release_cache(h.cache_id)
    ex.optimal_batch_size = best
    log.info("%s: decode crossover at batch %d (step ms by batch: %s)", ex.name, best,
             ", ".join(f"{b}: {1e3 * t:.1f}" for b, t in step_s.items()))
    return best
