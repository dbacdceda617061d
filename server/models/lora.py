"""LoRA adapters on a hosted model: a registry of loaded adapters in numbered slots,
and the deltas a forward adds to the projections of the tokens that name them.

A forward takes one slot id per token (-1: the base model).  Each token's delta
``(x @ A^T) @ B^T`` (the scale folded into B when read) is added to its row of the
base projection's output, after the base kernel ran (quantized ones included, the
delta in float).  The model fuses q/k/v and gate/up into one linear each: an
adapter's A matrices for a fused projection are stacked into one (R, in), so one
product serves the modules it targets there, and each module's B (held transposed,
(rank, width)) adds to its own outputs of the fused projection.

On the fused step ops (``model.fused_ops``: the kernels library is loaded) every
delta runs in C++ (``kernels/csrc/lora.cpp``): a ``LoraBatch`` per forward holds each
token's adapter, and adds every row's delta to a projection in one call, each row
with its own adapter's weights (the BGMV shape); the decode stack takes it too, so a
decode step with adapters stays one call (``DecodeStack.forward_lora``).  A row's
delta is one fixed sequence of float32 operations whatever shares the forward, so
batch-invariant models keep a token's bits independent of its batch.  Without the
fused ops the deltas are torch GEMMs: the tokens grouped by slot, in ascending slot
order, one small GEMM pair per (group, projection) on contiguous rows (gathered
once per projection where a group's rows are not).
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from .lora_read import ATTENTION, AdapterError, LoraWeights, module_shapes, read_adapter

log = logging.getLogger(__name__)

BASE = -1  # the slot id of a token that runs the base model
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PACK = 32  # a packed B block's outputs (lora.h's kLoraPack)
SITES = {"qkv_proj": 0, "o_proj": 1, "gate_up_proj": 2, "down_proj": 3}  # the decode stack's linears, in order


def _pack(b: torch.Tensor) -> torch.Tensor:
    """A module's B (width, rank) as lora.cpp reads it: (blocks, rank, PACK), block j
    its outputs [j PACK, (j + 1) PACK), zeros past its width."""
    width, rank = b.shape
    blocks = -(-width // PACK)
    padded = b.new_zeros(blocks * PACK, rank)
    padded[:width] = b
    return padded.view(blocks, PACK, rank).transpose(1, 2).contiguous()


class SiteWeights:
    """An adapter's weights for one projection of one layer as the forward reads them:
    the stacked A (R, in) of the modules it targets there, and per module its B
    packed (``_pack``), with its first output in the projection, its width and its
    first row in A: ``segments`` [(out_lo, width, r_lo, packed)]."""

    def __init__(self, a: torch.Tensor, segments: list[tuple[int, int, int, torch.Tensor]]):
        self.a, self.segments = a.contiguous(), segments
        self.nbytes = sum(t.numel() * t.element_size() for t in [self.a] + [p for *_, p in segments])

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """y (rows, out) += the delta of x (rows, in): torch GEMMs (the path off the fused ops)."""
        low = torch.mm(x, self.a.t())
        for out_lo, width, r_lo, packed in self.segments:
            blocks = torch.matmul(low[:, r_lo:r_lo + packed.shape[1]], packed)  # (blocks, rows, PACK)
            y[:, out_lo:out_lo + width] += blocks.transpose(0, 1).reshape(len(x), -1)[:, :width]


@dataclass
class Adapter:
    """A loaded adapter: its slot, where it came from, its weights per layer and
    projection (``sites[layer][projection]``) and who holds it."""

    name: str
    slot: int
    path: str
    rank: int
    modules: tuple[str, ...]
    digest: str
    sites: list[dict[str, SiteWeights]]
    nbytes: int
    kernel: object | None  # the same weights as a lora.cpp LoraAdapter (on the fused step ops), or None
    refs: int = 0  # live users (the engine's sequences): never evicted or removed while > 0
    last_used: int = 0  # the set's use counter when last acquired or released (LRU among idle ones)

    def info(self) -> dict:
        return {"name": self.name, "slot": self.slot, "path": self.path, "rank": self.rank,
                "modules": list(self.modules), "digest": self.digest, "bytes": self.nbytes, "refs": self.refs}


@dataclass
class BuiltAdapter:
    """An adapter read and arranged for the forward, not yet in a slot (``AdapterSet.build``)."""

    path: str
    read: LoraWeights
    sites: list[dict[str, SiteWeights]]
    kernel: object | None
    nbytes: int


def _sites(model, read: LoraWeights) -> list[dict[str, SiteWeights]]:
    """Per layer, the adapter's weights arranged for the model's projections as they
    are now (fused or not), on the model's device."""
    out, shapes = [], module_shapes(model.config)
    device = model.model.embed_tokens.weight.device
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        names = ["qkv_proj" if attn.qkv_proj is not None else None, "o_proj",
                 "gate_up_proj" if getattr(mlp, "gate_up_proj", None) is not None else None, "down_proj"]
        projections = {}
        for name in [n for n in names if n] + [m for m in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
                                                if hasattr(attn if m in ATTENTION else mlp, m)]:
            modules = FUSED.get(name, (name,))
            targeted = [m for m in modules if (i, m) in read.weights]
            if not targeted:
                continue
            widths = [shapes[m][0] for m in modules]
            segments, r_lo = [], 0
            for module, out_lo in zip(modules, itertools.accumulate([0] + widths)):
                if module in targeted:
                    b = read.weights[i, module][1]
                    segments.append((out_lo, b.shape[0], r_lo, _pack(b).to(device)))
                    r_lo += b.shape[1]
            projections[name] = SiteWeights(torch.cat([read.weights[i, m][0] for m in targeted]).to(device),
                                            segments)
        out.append(projections)
    return out


def _kernel(model, sites: list[dict[str, SiteWeights]]):
    """The adapter as lora.cpp's ``LoraAdapter`` (sharing the tensors), where the model
    runs the fused step ops on fused projections; else None (torch GEMMs only)."""
    layers = model.model.layers
    if not model.fused_ops or any(l.self_attn.qkv_proj is None or getattr(l.mlp, "gate_up_proj", None) is None
                                  for l in layers):
        return None
    kernel = torch.classes.ferrum_fused.LoraAdapter(len(layers))
    for i, projections in enumerate(sites):
        for name, site in projections.items():
            out_lo, widths, r_lo, packed = zip(*site.segments)
            kernel.set_site(i, SITES[name], site.a, list(packed), list(widths), list(out_lo), list(r_lo))
    return kernel


class AdapterSet:
    """The adapters a model can run, in slots 0..max_adapters-1 (``model.adapters``).

    ``add`` reads an adapter folder into a free slot, evicting the least recently
    used idle adapter when the slots or ``max_bytes`` are full; ``acquire`` /
    ``release`` count the users an adapter has (the engine holds one per live
    sequence), and one with users is never evicted or removed.  Thread-safe: reads
    run outside the lock, the forward reads slots without it (a slot it names is
    held, so it does not change under it)."""

    def __init__(self, model, max_adapters: int = 8, max_rank: int = 64, max_bytes: int | None = None):
        if getattr(model, "tp", None) is not None:
            raise AdapterError("model", "LoRA adapters are not supported with tensor parallelism")
        if max_adapters < 1 or max_rank < 1:
            raise ValueError("max_adapters and max_rank must be positive")
        self.model, self.max_adapters, self.max_rank, self.max_bytes = model, max_adapters, max_rank, max_bytes
        self.dtype = model.model.embed_tokens.weight.dtype  # the activations' (quantized linears take them too)
        self.slots: list[Adapter | None] = [None] * max_adapters
        self.by_name: dict[str, Adapter] = {}
        self.evicted: list[str] = []  # names evicted to make room, oldest first (for the engine's caches)
        self._lock = threading.Lock()
        self._clock = itertools.count(1)
        model.adapters = self

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.by_name.values())

    def add(self, name: str, folder: str | Path, replace: bool = False, root: str | Path | None = None) -> int:
        """Loads the adapter in ``folder`` as ``name``; returns its slot.  With
        ``replace``, a loaded ``name`` takes the new weights in its slot (its users
        see them from their next forward).  ``build`` then ``install``."""
        return self.install(name, self.build(name, folder, replace, root), replace)

    def build(self, name: str, folder: str | Path, replace: bool = False,
              root: str | Path | None = None) -> BuiltAdapter:
        """The adapter in ``folder`` read, checked and arranged for the forward, on the
        calling thread; the set does not change (``install`` puts it in a slot).
        ``root``: a resolved folder the adapter's files must lie inside."""
        if not name or not isinstance(name, str):
            raise AdapterError("name", "must be a non-empty string")
        if name in self.by_name and not replace:
            raise AdapterError("name", f"adapter {name!r} is already loaded")
        read = read_adapter(folder, self.model.config, self.max_rank, self.dtype, root)
        sites = _sites(self.model, read)
        kernel = _kernel(self.model, sites)
        nbytes = sum(s.nbytes for layer in sites for s in layer.values())
        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise AdapterError("max_bytes", f"the adapter needs {nbytes} bytes, over the limit of {self.max_bytes}")
        return BuiltAdapter(str(folder), read, sites, kernel, nbytes)

    def install(self, name: str, built: BuiltAdapter, replace: bool = False) -> int:
        """Puts an adapter ``build`` made in a slot as ``name`` (evicting idle ones to make
        room); returns its slot.  Refused, changing nothing, if ``name`` is loaded and not
        ``replace``, or if the adapters in use leave no room."""
        read, nbytes = built.read, built.nbytes
        with self._lock:
            old = self.by_name.get(name)
            if old is not None and not replace:
                raise AdapterError("name", f"adapter {name!r} is already loaded")
            self._make_room(nbytes - (old.nbytes if old else 0), keep=name)
            slot = old.slot if old else self.slots.index(None)
            adapter = Adapter(name, slot, built.path, read.rank, read.modules, read.digest, built.sites, nbytes,
                              built.kernel, refs=old.refs if old else 0, last_used=next(self._clock))
            self.slots[slot] = adapter
            self.by_name[name] = adapter
        log.info("adapter %s in slot %d: rank %d on %s, %.1f MiB", name, slot, read.rank, ",".join(read.modules),
                 nbytes / 2**20)
        return slot

    def _make_room(self, nbytes: int, keep: str) -> None:
        """Evicts idle adapters, least recently used first, until one more (of
        ``nbytes``) fits; refuses when the adapters in use leave no room."""
        def full() -> bool:
            slots_full = keep not in self.by_name and None not in self.slots
            return slots_full or (self.max_bytes is not None and self.nbytes + nbytes > self.max_bytes)

        if self.max_bytes is not None and nbytes > self.max_bytes:
            raise AdapterError("max_bytes", f"the adapter needs {nbytes} bytes, over the limit of {self.max_bytes}")
        while full():
            idle = [a for a in self.by_name.values() if a.refs == 0 and a.name != keep]
            if not idle:
                field = "max_adapters" if None not in self.slots else "max_bytes"
                raise AdapterError(field, f"every loaded adapter is in use (limit {self.max_adapters} adapters, "
                                          f"{self.max_bytes} bytes)")
            victim = min(idle, key=lambda a: a.last_used)
            self._drop(victim)
            self.evicted.append(victim.name)
            log.info("adapter %s evicted (least recently used, idle)", victim.name)

    def _drop(self, adapter: Adapter) -> None:
        self.slots[adapter.slot] = None
        del self.by_name[adapter.name]

    def remove(self, name: str) -> None:
        with self._lock:
            adapter = self._get(name)
            if adapter.refs:
                raise AdapterError("name", f"adapter {name!r} is in use by {adapter.refs} sequences")
            self._drop(adapter)
        log.info("adapter %s removed from slot %d", name, adapter.slot)

    def _get(self, name: str) -> Adapter:
        adapter = self.by_name.get(name)
        if adapter is None:
            raise AdapterError("name", f"unknown adapter {name!r}")
        return adapter

    def acquire(self, name: str) -> int:
        """One more user of ``name`` (pinned while it has any); returns its slot."""
        with self._lock:
            adapter = self._get(name)
            adapter.refs += 1
            adapter.last_used = next(self._clock)
            return adapter.slot

    def release(self, name: str) -> None:
        with self._lock:
            adapter = self._get(name)
            if adapter.refs <= 0:
                raise ValueError(f"adapter {name!r} released more often than acquired")
            adapter.refs -= 1
            adapter.last_used = next(self._clock)

    def touch(self, name: str) -> None:
        """A use of ``name`` (a new sequence): it moves off the eviction list's head."""
        with self._lock:
            self._get(name).last_used = next(self._clock)

    def slot(self, name: str) -> int:
        return self._get(name).slot

    def get(self, name: str) -> Adapter:
        return self._get(name)

    def info(self) -> list[dict]:
        with self._lock:
            return [a.info() for a in sorted(self.by_name.values(), key=lambda a: a.slot)]

    def deltas(self, slots: torch.Tensor, shape: torch.Size) -> LoraDeltas | None:
        """The forward's plan for tokens of ``shape`` (B, T) whose slots are ``slots``
        (that shape, or (B,) one per sequence); None when every token runs the base."""
        slots = slots.to("cpu", torch.int64)
        if tuple(slots.shape) == (shape[0],) and tuple(slots.shape) != tuple(shape):
            slots = slots.unsqueeze(1).expand(shape)
        elif tuple(slots.shape) != tuple(shape):
            raise ValueError(f"adapter slots of shape {tuple(slots.shape)} for tokens of shape {tuple(shape)}")
        flat = slots.reshape(-1)
        listed = flat.tolist()  # a step's few slots: Python lists cost less than torch ops on them
        present = sorted(set(listed) - {BASE})
        adapters = [self.slots[slot] if 0 <= slot < len(self.slots) else None for slot in present]
        for slot, adapter in zip(present, adapters):
            if adapter is None:
                raise ValueError(f"adapter slot {slot} holds no adapter")
        if not adapters:
            return None
        layers = range(len(self.model.model.layers))
        if self.model.fused_ops and all(a.kernel is not None for a in adapters):
            index = {slot: i for i, slot in enumerate(present)}  # slot -> the batch's index
            batch = torch.classes.ferrum_fused.LoraBatch(torch.tensor([index.get(s, -1) for s in listed],
                                                                      dtype=torch.int64))
            for adapter in adapters:
                batch.add_adapter(adapter.kernel)
            # the per-layer plans only where a forward leaves the decode stack (most steps never read them)
            return LoraDeltas(lambda: [KernelDeltas(batch, i, set().union(*(a.sites[i] for a in adapters)))
                                       for i in layers], batch)
        if self.model.batch_invariant:
            raise ValueError("batch-invariant adapters run on the fused ops' kernels, which are off")
        groups = []
        for slot, adapter in zip(present, adapters):
            rows = (flat == slot).nonzero().squeeze(1)
            first, last = rows[0].item(), rows[-1].item()
            groups.append((slice(first, last + 1) if last - first + 1 == len(rows) else rows, adapter.sites))
        order = None
        if any(not isinstance(rows, slice) for rows, _ in groups):
            # the groups' rows gathered once per projection, in group order: each group a slice of that
            order = torch.cat([torch.arange(r.start, r.stop) if isinstance(r, slice) else r for r, _ in groups]
                              ).to(self.model.model.embed_tokens.weight.device)
            sizes = [r.stop - r.start if isinstance(r, slice) else len(r) for r, _ in groups]
            starts = list(itertools.accumulate([0] + sizes))
            groups = [(slice(lo, hi), sites) for (lo, hi), (_, sites) in zip(zip(starts, starts[1:]), groups)]
        return LoraDeltas(lambda: [LayerDeltas([(rows, sites[i]) for rows, sites in groups if sites[i]], order)
                                   for i in layers])


class LoraDeltas:
    """One forward's adapters: ``layers``, per layer, its ``LayerDeltas`` or
    ``KernelDeltas`` (None where no adapter of the forward touches the layer), made on
    first use from ``make``; ``batch``: the forward's ``LoraBatch`` where the deltas
    run in lora.cpp (the decode stack takes it)."""

    def __init__(self, make: Callable[[], list], batch: object | None = None):
        self._make, self.batch = make, batch

    @functools.cached_property
    def layers(self) -> list:
        return [layer if layer else None for layer in self._make()]


class KernelDeltas:
    """One layer's deltas in lora.cpp: ``add(projection, x, y)`` adds every row's
    delta to ``y`` (the base output, in place) in one call."""

    def __init__(self, batch, layer: int, projections: set[str]):
        self.batch, self.layer, self.projections = batch, layer, projections

    def __bool__(self) -> bool:
        return bool(self.projections)

    def add(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if projection in self.projections:
            self.batch.add(self.layer, SITES[projection], x, y)
        return y


class LayerDeltas:
    """One layer's adapter groups in a forward, on torch GEMMs: ``add(projection, x, y)``
    adds each group's delta for ``projection`` to its rows of ``y`` (the base output,
    in place).  With ``order`` (rows of some group not contiguous), the groups' rows
    are gathered in that order once per projection, each group is a slice of them,
    and the deltas go back in one ``index_add_``."""

    def __init__(self, groups: list[tuple[slice, dict[str, SiteWeights]]], order: torch.Tensor | None = None):
        self.groups, self.order = groups, order

    def __bool__(self) -> bool:
        return bool(self.groups)

    def add(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # a view: the adds land in y
        if self.order is None:
            for rows, sites in self.groups:
                if projection in sites:
                    sites[projection].add_to(x2[rows], y2[rows])
            return y
        xs, delta = x2.index_select(0, self.order), None
        for rows, sites in self.groups:
            if projection in sites:
                if delta is None:  # zeros: the rows of groups without this projection add nothing
                    delta = y2.new_zeros(len(self.order), y2.shape[1])
                sites[projection].add_to(xs[rows], delta[rows])
        if delta is not None:
            y2.index_add_(0, self.order, delta)
        return y
