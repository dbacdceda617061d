"""Weights that change: UpdateWeights' executor side.  The new tensors (one safetensors
file, some or all of the checkpoint's) are read and checked as they arrive
(``weights_file.py``: names, shapes, dtypes, finite values, the checksum); then the
model is rebuilt with them the way it was loaded (converted, fused, quantized, packed:
``models.loader.load_model``) beside the serving one, off the worker (:func:`build`:
forwards go on meanwhile, on the old weights), and swapped in on the worker between two
forwards, so every forward runs on one version and decoding pauses only for the swap.
:class:`Weights` is the executor's record of what it serves; :func:`build` and
:func:`update` are the two steps, run on the executor.
With tensor parallelism the ranks rebuild on the worker (they agree to switch together).
Nothing changes until the swap: a bad file, or a caller that went away during the
rebuild, leaves the old weights serving."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ferrum_rpc.errors import Cancelled
from ferrum_rpc.hashing import updated_weights_digest, weights_digest
from ferrum_rpc.paths import cache_root
from ..models import TORCH_DTYPES, load_model, return_freed_memory
from .graphs import decode_graphs
from .weights_file import DTYPE_BYTES, FLOAT_DTYPES, HEADER_SLACK, WeightsUpload

log = logging.getLogger(__name__)


def checkpoint_index(path: str | Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of a model folder's safetensors files: name -> (shape, dtype)."""
    index = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                index[name.removeprefix("_orig_mod.")] = (tuple(part.get_shape()), part.get_dtype())
    return index


def stored_weights_digest(path: str | Path) -> str:
    """``hashing.weights_digest`` of a model folder, read back from the cache folder while
    none of its files changed (the same size, modification and change times, and inode);
    computed and stored otherwise.  Hashing the files is half a second of every start
    for SmolLM2 in float32, and they seldom change between starts."""
    folder = Path(path).resolve()
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    stamp = [[f.name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino] for f in files for st in [f.stat()]]
    store = cache_root() / "digests" / f"{hashlib.blake2b(str(folder).encode(), digest_size=16).hexdigest()}.json"
    try:
        saved = json.loads(store.read_text())
        if saved["files"] == stamp:
            return saved["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    digest = weights_digest(folder)
    with contextlib.suppress(OSError):  # a read-only cache folder: computed again next time
        store.parent.mkdir(parents=True, exist_ok=True)
        staged = store.with_suffix(f".{os.getpid()}.tmp")
        staged.write_text(json.dumps({"files": stamp, "digest": digest}))
        os.replace(staged, store)
    return digest


class Weights:
    """What an executor's weights are, as plain state: the checkpoint folder and its
    index, the tensors updates replaced on top of it, and the version and digest that
    name the result (``version`` 0 as loaded, one more per update)."""

    def __init__(self, path: str | Path | None = None, checkpoint: dict | None = None, digest: str = ""):
        self.path = Path(path) if path is not None else None
        self.checkpoint: dict[str, tuple[tuple[int, ...], str]] = checkpoint or {}
        self.digest = digest  # the KV fingerprint's: the files' (hashing.weights_digest), then each update's
        self.version = 0
        # every tensor an update has replaced (the latest of each name): the serving
        # weights are the checkpoint files with these on top, so each build starts from them
        self.applied: dict[str, torch.Tensor] = {}
        # the digest of each earlier version some live sequence still began under (an
        # export's fingerprint names the weights its KV was computed with)
        self.earlier: dict[int, str] = {}

    @classmethod
    def of_folder(cls, path: str | Path) -> Weights:
        return cls(path, checkpoint_index(path), stored_weights_digest(path))

    @property
    def limit_bytes(self) -> int:
        """The largest UpdateWeights file: every checkpoint tensor plus a header."""
        return sum((DTYPE_BYTES[dtype] if dtype in FLOAT_DTYPES else 8) * torch.Size(shape).numel()
                   for shape, dtype in self.checkpoint.values()) + HEADER_SLACK

    def upload(self, total_bytes: int) -> WeightsUpload:
        """Where an update's ``total_bytes`` go as they arrive (read and checked off the worker)."""
        return WeightsUpload(total_bytes, self.checkpoint)

    def digest_of(self, version: int) -> str:
        """The weights digest of weights version ``version``."""
        return self.digest if version == self.version else self.earlier[version]

    def on_top(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the weights after an update of ``tensors`` differ from the
        checkpoint files in: every earlier update's, then this one's over them."""
        return {**self.applied, **tensors}

    def advance(self, serving: dict[str, torch.Tensor], checksum: bytes) -> int:
        """Records an update swapped in (``serving``: its :meth:`on_top`); returns the new version."""
        self.earlier[self.version] = self.digest
        self.applied, self.version = serving, self.version + 1
        self.digest = updated_weights_digest(self.digest, checksum)
        return self.version

    def forget_except(self, versions: set[int]) -> None:
        """Forgets the digests of earlier versions no live sequence began under."""
        self.earlier = {v: d for v, d in self.earlier.items() if v in versions}


def _load(executor, tensors: dict[str, torch.Tensor]):
    """The executor's model built as it was loaded, from its checkpoint with ``tensors`` on top."""
    cfg = executor.config
    return load_model(executor.weights.path, TORCH_DTYPES[cfg.dtype], executor.device, cfg.linear_kernel,
                      cfg.quantize, cfg.step_ops, shard=executor.shard, batch_invariant=cfg.batch_invariant,
                      overrides=tensors)


def build(executor, tensors: dict[str, torch.Tensor]) -> tuple[object, float] | None:
    """The model rebuilt with ``tensors`` on top of what serves, and the seconds that took,
    built on the calling thread (any but the worker: nothing the forwards read changes),
    for :func:`update` to swap in; None with tensor parallelism (the ranks build on the
    worker, together)."""
    if executor.runner is not None:
        return None
    start = time.perf_counter()
    model = _load(executor, executor.weights.on_top(tensors))
    return model, time.perf_counter() - start


def update(executor, tensors: dict[str, torch.Tensor], checksum: bytes, invalidate: bool,
           gone: Callable[[], bool] = lambda: False, built: tuple[object, float] | None = None) -> dict:
    """Swaps in the model :func:`build` made of ``tensors`` (an upload's, checked), or
    rebuilds it here first where ``built`` is None (worker thread, between forwards);
    returns what the reply says.  ``gone()``: the caller went away (checked before the
    swap: then nothing changes)."""
    ex, weights = executor, executor.weights
    start = time.perf_counter()
    serving = weights.on_top(tensors)
    if built is not None:
        model, rebuild_s = built
    elif ex.runner is None:
        model = _load(ex, serving)
        rebuild_s = time.perf_counter() - start
    else:  # every rank builds its shard from its slices, and all switch to it or none does
        model = ex.runner.update(serving, lambda t: _load(ex, t), gone)
        rebuild_s = time.perf_counter() - start
    if ex.runner is None and gone():
        raise Cancelled("the caller cancelled the update; the old weights still serve")
    if ex.adapters is not None:  # the adapters' weights are the adapters': they stay
        model.adapters, ex.adapters.model = ex.adapters, model
    ex.model = model
    del model, built
    ex.graphs = decode_graphs(ex, ex.model)  # graphs captured on the old weights read those
    version = weights.advance(serving, checksum)
    ex.kv.start_generation(version)
    dropped = ex.kv.invalidate() if invalidate else 0
    weights.forget_except({seq.generation for seq in ex.kv.sequences()})
    return_freed_memory()  # the old model's tensors, back to the OS
    paused_s = time.perf_counter() - start
    log.info("%s: weights version %d (%d tensors): rebuilt in %.2fs, forwards paused %.2fs%s", ex.name, version,
             len(tensors), rebuild_s, paused_s, f", {dropped} sequences dropped" if invalidate else "")
    return {"weights_version": version, "tensors": len(tensors), "rebuild_s": rebuild_s, "paused_s": paused_s,
            "sequences_invalidated": dropped}
