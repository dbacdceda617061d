"""The split of a model over a tensor-parallel group (Megatron's, see the package
docstring): which slice of each weight a rank reads, its local config, and the
collectives a shard takes part in (all-reduces after attention and MLP, gathers for
the LM head and token choice)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ferrum_rpc.errors import StartupError
from ..choice.rows import ChosenTokens
from ..models.config import ModelConfig
from .choice import choose_sharded

log = logging.getLogger(__name__)


def check_divisible(cfg: ModelConfig, degree: int) -> None:
    """Refuses (StartupError: one line, exit code 2) a model whose heads, KV heads or MLP
    width the degree does not divide."""
    sizes = {"attention heads": cfg.num_heads, "KV heads": cfg.num_kv_heads,
             "intermediate size": cfg.intermediate_size}
    if cfg.num_experts:
        sizes["expert intermediate size"] = cfg.moe_intermediate_size
    for what, n in sizes.items():
        if n % degree:
            raise StartupError(f"--tensor-parallel {degree} does not divide the model's {n} {what}; "
                               f"choose a degree that divides {cfg.num_heads} heads and {cfg.num_kv_heads} KV heads")


def vocab_bounds(vocab: int, degree: int) -> list[tuple[int, int]]:
    """Each rank's [start, end) of the vocabulary: ceil(V/N) rows each, the last fewer."""
    per = -(-vocab // degree)
    return [(min(r * per, vocab), min((r + 1) * per, vocab)) for r in range(degree)]


class _Whole:
    """A tensor in memory, read the way :meth:`Shard._slice` reads a safetensors slice."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self.tensor.shape)

    def __getitem__(self, index) -> torch.Tensor:
        return self.tensor[index]


@dataclass
class Shard:
    """This process's place in the group, and what the split costs (for the bench)."""

    rank: int
    degree: int
    config: ModelConfig  # the whole model's
    allreduce_ns: int = 0  # time in the layers' all-reduces, summed
    gather_ns: int = 0  # time in the LM head's reduction, summed
    allreduce_bytes: int = 0
    lm_head_bytes: int = 0  # what the LM head's reductions and token choice sent to rank 0, summed
    choice_fallback_rows: int = 0  # token-choice rows that needed whole rows (see tp_choice)
    fallbacks: tuple[str, ...] = ()  # fast paths that cannot run sharded, and what runs instead
    fixed_order: bool = False  # the layers' sums in rank order (a batch-invariant model; see install)

    @classmethod
    def of_model(cls, rank: int, degree: int, path: str | Path) -> Shard:
        """Rank ``rank``'s shard of the model folder at ``path``, refused (StartupError)
        where the degree does not divide its heads and widths."""
        cfg = ModelConfig.from_dir(Path(path))
        check_divisible(cfg, degree)
        return cls(rank, degree, cfg)

    @property
    def vocab(self) -> tuple[int, int]:
        return vocab_bounds(self.config.vocab_size, self.degree)[self.rank]

    def local_config(self) -> ModelConfig:
        """The config this rank's modules are built with: its heads, columns and vocabulary."""
        cfg, n = self.config, self.degree
        lo, hi = self.vocab
        return replace(cfg, num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                       intermediate_size=cfg.intermediate_size // n,
                       moe_intermediate_size=cfg.moe_intermediate_size // n, vocab_size=hi - lo)

    # -- loading: only this rank's slices are read ----------------------------------------
    def read(self, files: list[Path], dtype: torch.dtype, device: torch.device,
             skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """This rank's slices of every tensor but those named in ``skip`` (safetensors'
        ``get_slice`` reads just those bytes)."""
        from safetensors import safe_open

        state = {}
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if "rotary_emb" in name or name.removeprefix("_orig_mod.") in skip:
                        continue
                    tensor = self._slice(name.removeprefix("_orig_mod."), sf.get_slice(name))
                    owned = tensor.to(device=device, dtype=dtype)
                    if owned.data_ptr() == tensor.data_ptr():  # possibly the file's mapping: own a copy
                        owned = owned.clone()
                    state[name.removeprefix("_orig_mod.")] = owned
        return state

    def slice_tensor(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a whole checkpoint tensor (an UpdateWeights'), in memory of its own."""
        return self._slice(name, _Whole(tensor)).clone(memory_format=torch.contiguous_format)

    def _slice(self, name: str, sl) -> torch.Tensor:
        r, n = self.rank, self.degree
        shape = sl.get_shape()

        def part(dim: int, size: int) -> torch.Tensor:
            idx = [slice(None)] * len(shape)
            idx[dim] = slice(r * size, (r + 1) * size)
            return sl[tuple(idx)]

        leaf = name.rsplit(".", 2)
        if name == "lm_head.weight":
            lo, hi = self.vocab
            return sl[lo:hi]
        if ".self_attn." in name and leaf[-2] in ("q_proj", "k_proj", "v_proj"):
            return part(0, shape[0] // n)  # whole heads: rows h*D..(h+1)*D are head h
        if ".self_attn.o_proj." in name or ".mlp.down_proj." in name:
            return self._row_parallel(name, sl, shape, part)
        if ".mlp.experts." in name:
            return self._expert(name, sl, shape, part)
        if leaf[-2] in ("gate_proj", "up_proj") and ".mlp." in name:
            return part(0, shape[0] // n)
        return sl[:]  # norms, the router, embeddings: whole on every rank

    def _row_parallel(self, name, sl, shape, part) -> torch.Tensor:
        if name.endswith("bias"):  # added once: by rank 0, zero elsewhere
            return sl[:] if self.rank == 0 else torch.zeros_like(sl[:])
        return part(len(shape) - 1, shape[-1] // self.degree)

    def _expert(self, name, sl, shape, part) -> torch.Tensor:
        """Expert columns: per-expert ``experts.{e}.{gate,up,down}_proj.weight`` or the
        stacked ``experts.gate_up_proj`` (E, 2I, C) / ``experts.down_proj`` (E, C, I)."""
        n, r = self.degree, self.rank
        if name.endswith("gate_up_proj"):
            i = shape[1] // 2
            step = i // n
            gate, up = sl[:, r * step:(r + 1) * step], sl[:, i + r * step:i + (r + 1) * step]
            return torch.cat([gate, up], dim=1)
        if name.endswith("down_proj") or name.endswith("down_proj.weight"):
            return part(len(shape) - 1, shape[-1] // n)
        return part(len(shape) - 2, shape[-2] // n)  # gate_proj / up_proj: (.., I, C)

    # -- the model: all-reduces and gathers -------------------------------------------------
    def install(self, model: torch.nn.Module) -> None:
        """Sums row-parallel outputs over the ranks after every attention and MLP block,
        and gathers heads where attention weights are asked for (analysis)."""
        for layer in model.model.layers:
            layer.self_attn.register_forward_hook(self._all_reduce_hook)
            layer.mlp.register_forward_hook(self._all_reduce_hook)
            layer.self_attn.gather_heads = self.gather_heads
        model.layer_ops = None  # the whole-layer decode op has no all-reduce inside: the per-op path runs
        model.tp = self
        self.fixed_order = getattr(model, "batch_invariant", False)

    def _all_reduce_hook(self, _module, _inputs, out: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
        if self.fixed_order:
            # Batch-invariant: every rank's part, summed in rank order.  A library
            # all-reduce splits the tensor into chunks by its size, and a chunk's order
            # of summation depends on where it falls, so a row's bits would follow the
            # batch's row count (at three ranks and more).
            parts = [torch.empty_like(out) for _ in range(self.degree)]
            dist.all_gather(parts, out.contiguous())
            total = parts[0]
            for part in parts[1:]:
                total += part
            out.copy_(total)
        else:
            dist.all_reduce(out)
        self.allreduce_ns += time.perf_counter_ns() - t0
        self.allreduce_bytes += out.numel() * out.element_size()
        return out

    def gather_heads(self, weights: torch.Tensor) -> torch.Tensor:
        """(B, H/N, T, S) attention weights of this rank's heads -> (B, H, T, S) on every rank."""
        parts = [torch.empty_like(weights) for _ in range(self.degree)]
        dist.all_gather(parts, weights.contiguous())
        return torch.cat(parts, dim=1)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``tensor`` (the same shape on each), counting the bytes rank 0 receives."""
        parts = [torch.empty_like(tensor) for _ in range(self.degree)]
        dist.all_gather(parts, tensor.contiguous())
        self.lm_head_bytes += tensor.numel() * tensor.element_size() * (self.degree - 1)
        return parts

    def gather_rows(self, local: torch.Tensor) -> torch.Tensor:
        """This rank's (R, V/N) slices -> (R, V) whole rows on every rank."""
        widths = [hi - lo for lo, hi in vocab_bounds(self.config.vocab_size, self.degree)]
        padded = torch.full((local.shape[0], max(widths)), float("-inf"), device=local.device)
        padded[:, :local.shape[1]] = local
        parts = self.all_gather(padded)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    def choose(self, local: torch.Tensor, requests) -> ChosenTokens:
        """Token choice over this rank's vocabulary slice, reduced across ranks
        (:func:`tp_choice.choose_sharded`); the same result on every rank."""
        t0 = time.perf_counter_ns()
        device = local.device  # NCCL gathers device tensors; the choice computes on the CPU

        def gather(t: torch.Tensor) -> list[torch.Tensor]:
            return [p.cpu() for p in self.all_gather(t.to(device))]

        def rows(t: torch.Tensor) -> torch.Tensor:
            return self.gather_rows(t.to(device)).cpu()

        chosen, fell = choose_sharded(local.float().cpu(), requests, self.rank, self.vocab[0],
                                      self.config.vocab_size, -(-self.config.vocab_size // self.degree), gather,
                                      rows)
        if fell and not self.choice_fallback_rows:
            log.info("tensor parallel: a token choice needed whole rows (top-k above 4096, a nucleus wider "
                     "than 256 tokens or top-k ties past the candidates); counted from now on, not logged again")
        self.choice_fallback_rows += fell
        self.gather_ns += time.perf_counter_ns() - t0
        return chosen

    def reduce_logits(self, local: torch.Tensor | None, top: int | None) -> torch.Tensor | None:
        """This rank's (N, V/N) float32 logits -> (N, V) on rank 0 (None elsewhere).

        ``top`` (ARGMAX: 1, TOP_K: k): only each rank's k best per row cross; rank 0 gets
        the k global best in their places and -inf elsewhere, which every ARGMAX/TOP_K
        consumer reads as the full row.  None: whole rows are gathered (FULL); 0: nothing."""
        if local is None or top == 0:  # 0: no row goes back (token choice only)
            return None
        t0 = time.perf_counter_ns()
        bounds = vocab_bounds(self.config.vocab_size, self.degree)
        widths = [hi - lo for lo, hi in bounds]
        rows = local.shape[0]
        if top is not None and top <= min(widths):
            values, ids = local.topk(top, dim=-1)  # (N, k) each
            ids += bounds[self.rank][0]
            all_values = [torch.empty_like(values) for _ in range(self.degree)]
            all_ids = [torch.empty_like(ids) for _ in range(self.degree)]
            dist.all_gather(all_values, values)
            dist.all_gather(all_ids, ids)
            self.lm_head_bytes += (values.numel() * values.element_size() + ids.numel() * ids.element_size()) \
                * (self.degree - 1)
            out = None
            if self.rank == 0:
                values, ids = torch.cat(all_values, dim=1), torch.cat(all_ids, dim=1)  # (N, N_ranks*k)
                best, where = values.topk(top, dim=-1)
                out = torch.full((rows, self.config.vocab_size), float("-inf"), device=local.device)
                out.scatter_(1, ids.gather(1, where), best)
        else:
            out = self.gather_rows(local)
            out = out if self.rank == 0 else None
        self.gather_ns += time.perf_counter_ns() - t0
        return out


