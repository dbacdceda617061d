"""Decode steps on a CUDA device as replayed CUDA graphs.

An eager decode step of a small model launches a few hundred kernels, each costing
the host more than the GPU needs to run it.  A graph captures one whole step (the
embedding, every layer with its pool write and paged attention, the final norm
and the LM head) once per shape and replays it with one launch.  The shape is a
bucket: the batch padded up to the next of ``batch_buckets`` and each sequence's
block table padded to the next power of two of blocks, so a few dozen graphs
serve every decode batch.  Padded rows read block 0 at position 0 and write the
pool's scratch block, which no sequence's table holds; padded table entries lie
past each sequence's end, where the attention mask hides them.

The inputs (token ids, positions, write slots, block tables) live in one static
device buffer per graph, filled from one pinned host buffer before each replay;
the graph's logits are copied out before another graph runs, since all of them
share one memory pool.  Only plain decode steps take this path: every step one
token whose logits row is asked for, the base model (no LoRA adapter), and no
hidden states or attention weights asked.  Anything else runs the eager forward.

``capture=False`` runs the same padded static-shape step eagerly (on any device):
what the CPU tests use to check the padding against the plain forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..kv.pool import KvBatch, KvPool
from .forward import Rows, Step

log = logging.getLogger(__name__)

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_BLOCKS = 4  # the smallest table width a graph is captured for


def decode_graphs(executor, model: torch.nn.Module) -> DecodeGraphs | None:
    """Plain decode steps of ``executor``'s ``model`` as replayed CUDA graphs, or None
    (every step eager): on a CUDA device with --cuda-graphs auto, not split over ranks
    and with no mixture of experts (whose routing picks rows by value)."""
    config = executor.config
    if (executor.device.type != "cuda" or config.cuda_graphs != "auto" or executor.shard is not None
            or executor.model_config.num_experts):
        return None
    return DecodeGraphs(model, executor.pool, config.max_batch_size, -(-executor.max_seq_len // config.block_size))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None  # None: replayed eagerly (capture=False)
    inputs: torch.Tensor  # (B * (3 + W),) int64 on the device: ids, positions, write slots, tables
    staging: torch.Tensor  # the same, pinned on the host
    kv: KvBatch  # the step's static view of the pool (its tensors are views of ``inputs``)
    ids: torch.Tensor  # (B, 1)
    logits: torch.Tensor | None  # (B, V) float32, the graph's output
    copied: torch.cuda.Event | None  # recorded after the inputs' copy to the device (on a GPU)


class DecodeGraphs:
    """Captures and replays whole decode steps of ``model`` over ``pool``.

    Args:
        model: the loaded model (its ``forward`` and ``logits``).
        pool: the KV pool the steps read and write.
        max_batch: the most sequences one step carries (larger batches run eagerly).
        max_blocks: the most blocks one sequence's table holds.
        capture: capture CUDA graphs (False: the same static-shape steps, run eagerly).
    """

    def __init__(self, model: torch.nn.Module, pool: KvPool, max_batch: int, max_blocks: int, capture: bool = True):
        self.model, self.pool, self.capture = model, pool, capture
        self.batch_buckets = [b for b in BATCH_BUCKETS if b < max_batch] + [max_batch]
        self.max_blocks = max_blocks
        self.graphs: dict[tuple[int, int], _Graph] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.broken = ""  # why capturing failed (then every step runs eagerly)

    def describe(self) -> str:
        return ("decode=cuda-graphs (batch buckets " + " ".join(map(str, self.batch_buckets)) + ")"
                if not self.broken else f"decode=eager (cuda graphs failed: {self.broken})")

    def takes(self, steps: list[Step]) -> bool:
        """Whether ``steps`` is a plain decode step a graph can run."""
        return (not self.broken and 0 < len(steps) <= self.batch_buckets[-1]
                and all(len(s.tokens) == 1 and s.rows is Rows.LAST and not s.adapter and not s.hidden
                        and not s.attention for s in steps)
                and max(len(s.block_ids) for s in steps) <= self.max_blocks)

    def forward(self, steps: list[Step]) -> torch.Tensor | None:
        """(len(steps), V) float32 logits of one decode step, each sequence's token
        written to the pool at its position; None, having changed nothing, where its
        graph could not be captured (the caller runs the eager forward)."""
        n = len(steps)
        batch = next(b for b in self.batch_buckets if b >= n)
        need = max(len(s.block_ids) for s in steps)
        width = min(self.max_blocks, max(MIN_BLOCKS, 1 << (need - 1).bit_length()))
        entry = self.graphs.get((batch, width)) or self._capture(batch, width)
        if entry is None:
            return None
        if entry.copied is not None:
            entry.copied.synchronize()  # the last step's inputs have left the staging buffer
        host = entry.staging.numpy()
        bs, scratch = self.pool.block_size, self.pool.scratch_block * self.pool.block_size
        host[:] = 0
        ids, positions, slots = host[:batch], host[batch:2 * batch], host[2 * batch:3 * batch]
        tables = host[3 * batch:].reshape(batch, width)
        slots[:] = scratch
        for i, s in enumerate(steps):
            table = s.block_ids
            ids[i], positions[i] = s.tokens[0], s.start
            slots[i] = table[s.start // bs] * bs + s.start % bs
            tables[i, :len(table)] = table
        entry.inputs.copy_(entry.staging, non_blocking=True)
        if entry.copied is not None:
            entry.copied.record()
        if entry.graph is not None:
            entry.graph.replay()
            logits = entry.logits
        else:
            logits = self._step(entry)
        return logits[:n].clone()

    def _step(self, entry: _Graph) -> torch.Tensor:
        entry.kv._mask = None  # built from the positions inside the step (and the graph)
        with torch.inference_mode():
            hidden = self.model(entry.ids, entry.kv.positions, entry.kv)  # (B, 1, C)
            return self.model.logits(hidden[:, -1])

    def _capture(self, batch: int, width: int) -> _Graph | None:
        device = self.pool.k.device
        staging = torch.zeros(batch * (3 + width), dtype=torch.int64, pin_memory=device.type == "cuda")
        inputs = torch.zeros_like(staging, device=device)
        inputs[2 * batch:3 * batch] = self.pool.scratch_block * self.pool.block_size  # warm-ups write scratch only
        kv = KvBatch.static(self.pool, tables=inputs[3 * batch:].view(batch, width),
                            positions=inputs[batch:2 * batch].view(batch, 1), write_slots=inputs[2 * batch:3 * batch])
        entry = _Graph(None, inputs, staging, kv, inputs[:batch].view(batch, 1), None,
                       torch.cuda.Event() if device.type == "cuda" else None)
        if self.capture:
            try:
                entry.graph, entry.logits = self._record(entry)
            except Exception as exc:  # noqa: BLE001 (any failure: this model's decodes run eagerly)
                self.broken = f"{type(exc).__name__}: {exc}"
                log.warning("capturing a CUDA graph of a decode step (batch %d, %d blocks) failed; decode "
                            "steps run eagerly: %s", batch, width, self.broken)
                return None
            log.info("captured a CUDA graph of a decode step: batch %d, up to %d tokens a sequence", batch,
                     width * self.pool.block_size)
        self.graphs[(batch, width)] = entry
        return entry

    def _record(self, entry: _Graph) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warms the step up on a side stream (its kernels chosen, its workspaces made), then captures it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(entry)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another model's worker thread may use the device meanwhile
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            logits = self._step(entry)
        return graph, logits
