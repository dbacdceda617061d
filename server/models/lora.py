"""LoRA adapters on a hosted model: a registry of loaded adapters in numbered slots,
and the deltas a forward adds to the projections of the tokens that name them.

A forward takes one slot id per token (-1: the base model).  Its tokens are grouped
by slot, in ascending slot order, and each group's delta ``(x @ A^T) @ B^T`` (the
scale folded into B when read) is added to the rows of the base projection's output,
after the base kernel ran (quantized ones included, the delta in float): the gathered
low-rank products of Punica's SGMV, one small GEMM pair per (group, projection).
Where a group's rows are contiguous (the engine can order a batch by adapter) they
are views, else gathered and scattered back.  The model fuses q/k/v and gate/up into
one linear each: an adapter's A matrices for a fused projection are stacked into one
(R, in) and its B matrices placed block-diagonally in one (out, R), each on its
module's rows of the fused output (zeros elsewhere): two GEMMs per group and fused
projection, not one per module (small GEMMs cost their dispatch more than their
arithmetic), for a B up to 3x its size on q/k/v.

Batch-invariant models (``model.batch_invariant``) compute every delta with the
tiled linear whose rows do not depend on the row count, and add it elementwise:
a token's bits do not depend on the rows that share its forward.
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from .lora_read import ATTENTION, AdapterError, LoraWeights, module_shapes, read_adapter

log = logging.getLogger(__name__)

BASE = -1  # the slot id of a token that runs the base model
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class SiteWeights:
    """An adapter's weights for one projection of one layer as the forward reads them:
    the stacked A (R, in) of the modules it targets there and their B matrices
    block-diagonally in one (out, R), and both transposed (views, for the GEMMs)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        self.a, self.b = a.contiguous(), b.contiguous()
        self.a_t, self.b_t = self.a.t(), self.b.t()
        self.nbytes = self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()


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
    refs: int = 0  # live users (the engine's sequences): never evicted or removed while > 0
    last_used: int = 0  # the set's use counter when last acquired or released (LRU among idle ones)

    def info(self) -> dict:
        return {"name": self.name, "slot": self.slot, "path": self.path, "rank": self.rank,
                "modules": list(self.modules), "digest": self.digest, "bytes": self.nbytes, "refs": self.refs}


def _sites(model, read: LoraWeights) -> list[dict[str, SiteWeights]]:
    """Per layer, the adapter's weights arranged for the model's projections as they
    are now (fused or not)."""
    out, shapes = [], module_shapes(model.config)
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
            a = torch.cat([read.weights[i, m][0] for m in targeted])
            b = a.new_zeros(sum(widths), a.shape[0])
            r_lo = 0
            for module, out_lo, width in zip(modules, itertools.accumulate([0] + widths), widths):
                if module in targeted:
                    part = read.weights[i, module][1]
                    b[out_lo:out_lo + width, r_lo:r_lo + part.shape[1]] = part
                    r_lo += part.shape[1]
            projections[name] = SiteWeights(a, b)
        out.append(projections)
    return out


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

    def add(self, name: str, folder: str | Path, replace: bool = False) -> int:
        """Loads the adapter in ``folder`` as ``name``; returns its slot.  With
        ``replace``, a loaded ``name`` takes the new weights in its slot (its users
        see them from their next forward)."""
        if not name or not isinstance(name, str):
            raise AdapterError("name", "must be a non-empty string")
        if name in self.by_name and not replace:
            raise AdapterError("name", f"adapter {name!r} is already loaded")
        read = read_adapter(folder, self.model.config, self.max_rank, self.dtype)
        sites = _sites(self.model, read)
        nbytes = sum(s.nbytes for layer in sites for s in layer.values())
        with self._lock:
            old = self.by_name.get(name)
            if old is not None and not replace:
                raise AdapterError("name", f"adapter {name!r} is already loaded")
            self._make_room(nbytes - (old.nbytes if old else 0), keep=name)
            slot = old.slot if old else self.slots.index(None)
            adapter = Adapter(name, slot, str(folder), read.rank, read.modules, read.digest, sites, nbytes,
                              refs=old.refs if old else 0, last_used=next(self._clock))
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
        groups = []
        for slot in torch.unique(flat).tolist():  # ascending: a fixed order whatever the batch
            if slot == BASE:
                continue
            adapter = self.slots[slot] if 0 <= slot < len(self.slots) else None
            if adapter is None:
                raise ValueError(f"adapter slot {slot} holds no adapter")
            rows = (flat == slot).nonzero().squeeze(1)
            first, last = rows[0].item(), rows[-1].item()
            groups.append((slice(first, last + 1) if last - first + 1 == len(rows) else rows, adapter.sites))
        if not groups:
            return None
        invariant, order = self.model.batch_invariant, None
        if not invariant and any(not isinstance(rows, slice) for rows, _ in groups):
            # the groups' rows gathered once per projection, in group order: each group a slice of that
            order = torch.cat([torch.arange(r.start, r.stop) if isinstance(r, slice) else r for r, _ in groups])
            sizes = [r.stop - r.start if isinstance(r, slice) else len(r) for r, _ in groups]
            starts = list(itertools.accumulate([0] + sizes))
            groups = [(slice(lo, hi), sites) for (lo, hi), (_, sites) in zip(zip(starts, starts[1:]), groups)]
        return LoraDeltas([LayerDeltas([(rows, sites[i]) for rows, sites in groups if sites[i]], invariant, order)
                           for i in range(len(self.model.model.layers))])


@dataclass
class LoraDeltas:
    """One forward's adapters: per layer, its ``LayerDeltas`` (or None where no adapter
    of the forward touches the layer)."""

    layers: list[LayerDeltas | None]

    def __post_init__(self):
        self.layers = [layer if layer.groups else None for layer in self.layers]


class LayerDeltas:
    """One layer's adapter groups in a forward: ``add(projection, x, y)`` adds each
    group's delta for ``projection`` to its rows of ``y`` (the base output, in place).
    With ``order`` (rows of some group not contiguous, default kernels), the groups'
    rows are gathered in that order once per projection, each group is a slice of
    them, and the deltas go back in one ``index_add_``."""

    def __init__(self, groups: list[tuple[slice | torch.Tensor, dict[str, SiteWeights]]], invariant: bool,
                 order: torch.Tensor | None = None):
        self.groups, self.invariant, self.order = groups, invariant, order

    def add(self, projection: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])  # a view: the adds land in y
        if self.order is not None:
            return self._add_gathered(projection, x2, y2, y)
        for rows, sites in self.groups:
            site = sites.get(projection)
            if site is None:
                continue
            if self.invariant:  # the tiled linear: a row's sums in one order at any row count, added elementwise
                tiled = torch.ops.ferrum_fused.linear_rows_tiled
                if isinstance(rows, slice):
                    y2[rows] += tiled(tiled(x2[rows].contiguous(), site.a), site.b)
                else:
                    y2.index_add_(0, rows, tiled(tiled(x2.index_select(0, rows), site.a), site.b))
            elif isinstance(rows, slice):
                y2[rows].addmm_(torch.mm(x2[rows], site.a_t), site.b_t)
            else:
                y2.index_add_(0, rows, torch.mm(torch.mm(x2.index_select(0, rows), site.a_t), site.b_t))
        return y

    def _add_gathered(self, projection: str, x2: torch.Tensor, y2: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        xs = x2.index_select(0, self.order)
        delta = None
        for rows, sites in self.groups:
            site = sites.get(projection)
            if site is None:
                continue
            if delta is None:  # zeros: the rows of groups without this projection add nothing
                delta = y2.new_zeros(len(self.order), y2.shape[1])
            torch.mm(torch.mm(xs[rows], site.a_t), site.b_t, out=delta[rows])
        if delta is not None:
            y2.index_add_(0, self.order, delta)
        return y
