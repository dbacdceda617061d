"""Weights that change: UpdateWeights' executor side.  The new tensors (one safetensors
file, some or all of the checkpoint's) are read and checked as they arrive
(``weights_file.py``: names, shapes, dtypes, finite values, the checksum); then the
model is rebuilt with them the way it was loaded (converted, fused, quantized, packed:
``models.loader.load_model``) beside the serving one, off the worker (``build_weights``:
forwards go on meanwhile, on the old weights), and swapped in on the worker between two
forwards, so every forward runs on one version and decoding pauses only for the swap.
With tensor parallelism the ranks rebuild on the worker (they agree to switch together).
Nothing changes until the swap: a bad file, or a caller that went away during the
rebuild, leaves the old weights serving."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

from ferrum_rpc.errors import Cancelled
from ferrum_rpc.hashing import updated_weights_digest
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


class UpdatesWeights:
    """Mixed into :class:`~.executor.TorchExecutor` (its ``model``, ``config``, ``device``,
    ``kv``, ``shard``, ``runner``, ``adapters``, ``name``, ``path``)."""

    weights_version = 0
    checkpoint: dict[str, tuple[tuple[int, ...], str]] = {}
    # every tensor an update has replaced (the latest of each name): the serving weights
    # are the checkpoint files with these on top, so each build starts from them
    applied: dict[str, torch.Tensor] = {}
    # the weights digest of each version some live sequence still began under (an
    # export's fingerprint names the weights its KV was computed with)
    version_digests: dict[int, str] = {}

    @property
    def update_limit_bytes(self) -> int:
        """The largest UpdateWeights file: every checkpoint tensor plus a header."""
        return sum((DTYPE_BYTES[dtype] if dtype in FLOAT_DTYPES else 8) * torch.Size(shape).numel()
                   for shape, dtype in self.checkpoint.values()) + HEADER_SLACK

    def weights_upload(self, total_bytes: int) -> WeightsUpload:
        """Where an update's ``total_bytes`` go as they arrive (read and checked off the worker)."""
        return WeightsUpload(total_bytes, self.checkpoint)

    def digest_of(self, generation: int) -> str:
        """The weights digest of weights version ``generation``."""
        return self.weights_digest if generation == self.weights_version else self.version_digests[generation]

    def on_top(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The tensors the weights after an update of ``tensors`` differ from the
        checkpoint files in: every earlier update's, then this one's over them."""
        return {**self.applied, **tensors}

    def _build(self, tensors: dict[str, torch.Tensor]):
        cfg = self.config
        return load_model(self.path, TORCH_DTYPES[cfg.dtype], self.device, cfg.linear_kernel, cfg.quantize,
                          cfg.step_ops, shard=self.shard, batch_invariant=cfg.batch_invariant, overrides=tensors)

    def build_weights(self, tensors: dict[str, torch.Tensor]) -> tuple[object, float] | None:
        """The model rebuilt with ``tensors`` and the seconds that took, built on the
        calling thread (any but the worker: nothing the forwards read changes), for
        ``update_weights`` to swap in; None with tensor parallelism (the ranks build on
        the worker, together)."""
        if self.runner is not None:
            return None
        start = time.perf_counter()
        model = self._build(self.on_top(tensors))
        return model, time.perf_counter() - start

    def update_weights(self, tensors: dict[str, torch.Tensor], checksum: bytes, invalidate: bool,
                       gone: Callable[[], bool] = lambda: False, built: tuple[object, float] | None = None) -> dict:
        """Swaps in the model ``build_weights`` made of ``tensors`` (an upload's, checked),
        or rebuilds it here first where ``built`` is None (worker thread, between
        forwards); returns what the reply says.  ``gone()``: the caller went away
        (checked before the swap: then nothing changes)."""
        start = time.perf_counter()
        serving = self.on_top(tensors)
        if built is not None:
            model, rebuild_s = built
        elif self.runner is None:
            model = self._build(serving)
            rebuild_s = time.perf_counter() - start
        else:  # every rank builds its shard from its slices, and all switch to it or none does
            model = self.runner.update(serving, self._build, gone)
            rebuild_s = time.perf_counter() - start
        if self.runner is None and gone():
            raise Cancelled("the caller cancelled the update; the old weights still serve")
        if self.adapters is not None:  # the adapters' weights are the adapters': they stay
            model.adapters, self.adapters.model = self.adapters, model
        self.model, self.applied = model, serving
        del model, built
        self.graphs = decode_graphs(self, self.model)  # graphs captured on the old weights read those
        before = {**self.version_digests, self.weights_version: self.weights_digest}
        self.weights_version += 1
        self.weights_digest = updated_weights_digest(self.weights_digest, checksum)
        self.kv.start_generation(self.weights_version)
        dropped = self.kv.invalidate() if invalidate else 0
        live = {seq.generation for seq in self.kv.sequences()}
        self.version_digests = {v: d for v, d in before.items() if v in live}
        return_freed_memory()  # the old model's tensors, back to the OS
        paused_s = time.perf_counter() - start
        log.info("%s: weights version %d (%d tensors): rebuilt in %.2fs, forwards paused %.2fs%s", self.name,
                 self.weights_version, len(tensors), rebuild_s, paused_s,
                 f", {dropped} sequences dropped" if invalidate else "")
        return {"weights_version": self.weights_version, "tensors": len(tensors), "rebuild_s": rebuild_s,
                "paused_s": paused_s, "sequences_invalidated": dropped}
