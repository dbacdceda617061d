"""Tensor parallelism on torch.distributed: one rank per device (or per machine),
each holding a shard of the weights and of the KV pool.

Megatron's split, as gpt-fast's ``tp.py`` does it, on our own modules: q/k/v and
gate/up are column-parallel (each rank owns whole heads, whole MLP columns),
o and down are row-parallel, so each layer costs two all-reduces of the hidden
states (forward hooks on ``self_attn`` and ``mlp``).  The KV pool splits by KV
head with the heads.  The LM head is vocabulary-parallel: ARGMAX and TOP_K
reduce each rank's own top-k (k values a row cross the wire, not V); FULL rows
gather whole rows; server-side token choice reduces a few numbers a row
(``tp_choice``), whole rows only for the rare policies it cannot decide otherwise.
Embeddings stay whole on every rank: a lookup reads one row a token, so sharding
them would save memory but no bandwidth, and cost one more all-reduce a forward.

Qwen3-MoE experts shard by expert *columns*: every rank holds every expert's
1/N of gate/up columns and down rows.  The router then runs identically on every
rank, each routed expert's work splits evenly whatever the routing, and the
MoE block needs the same one all-reduce as a dense MLP.  Sharding by expert
would leave a rank idle whenever its experts got no tokens (at batch 1, most
ranks) and needs token exchange (all-to-all) on top.

Rank 0 owns the gRPC server, the worker and the block manager.  Each forward it
broadcasts the plan (per step: tokens, start, block table, which rows go
through the LM head; plus the top-k it needs and each token choice's policy,
seed and penalty counts), then every rank runs the same
``forward.forward`` over its shard.  Block ids are the same on every rank.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ferrum_rpc.errors import RankLost, StartupError
from ..engine.forward import Rows, forward
from ..models.config import ModelConfig
from ..choice.sampling import ChosenTokens
from .choice import choose_sharded

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
IDLE_TIMEOUT = timedelta(days=365)  # ranks wait for the next plan without end; rank 0's watchdog bounds a forward


# -- the split --------------------------------------------------------------------------
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
    def read(self, files: list[Path], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
        """This rank's slices of every tensor (safetensors' ``get_slice`` reads just those bytes)."""
        from safetensors import safe_open

        state = {}
        for f in files:
            with safe_open(f, framework="pt", device="cpu") as sf:
                for name in sf.keys():
                    if "rotary_emb" in name:
                        continue
                    tensor = self._slice(name.removeprefix("_orig_mod."), sf.get_slice(name))
                    owned = tensor.to(device=device, dtype=dtype)
                    if owned.data_ptr() == tensor.data_ptr():  # possibly the file's mapping: own a copy
                        owned = owned.clone()
                    state[name.removeprefix("_orig_mod.")] = owned
        return state

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

    def _all_reduce_hook(self, _module, _inputs, out: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter_ns()
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


# -- plans: what rank 0 sends each forward ----------------------------------------------------
@dataclass
class PlannedStep:
    """A step as the other ranks see it: what ``forward.forward`` reads, nothing more."""

    tokens: list[int]
    start: int
    block_ids: list[int]
    rows: Rows
    hidden: dict[int, None] | None = None
    attention: dict[int, None] | None = None
    heads: tuple[int, ...] = ()

    @classmethod
    def of(cls, step) -> PlannedStep:
        return cls(list(step.tokens), step.start, list(step.block_ids), step.rows,
                   dict.fromkeys(step.hidden) if step.hidden else None,
                   dict.fromkeys(step.attention) if step.attention else None, tuple(step.heads))


def _send(message: tuple, device: torch.device) -> None:
    dist.broadcast_object_list([message], src=0, device=device if device.type == "cuda" else None)


def _receive(device: torch.device) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


class Runner:
    """Rank 0's side: broadcasts each plan, runs its own shard, reduces the logits.

    Any failure inside a forward (a collective that errs because a rank died, an
    error on this rank that would leave the others waiting) fails the group for
    good: the ranks can no longer be trusted to be in step, so nothing is served
    again (see :func:`fail`)."""

    def __init__(self, shard: Shard, device: torch.device):
        self.shard, self.device = shard, device
        self.busy_since: float | None = None  # monotonic start of the forward in progress
        self.forwards = 0
        CURRENT["runner"] = self
        if (watchdog := CURRENT.get("watchdog")) is not None:
            watchdog.runner = self

    def forward(self, model, pool, steps, top: int | None,
                requests: list | None = None) -> tuple[torch.Tensor | None, ChosenTokens | None]:
        """Runs one forward on every rank: the logits rows reduced as ``top`` says (see
        :meth:`Shard.reduce_logits`) and, for ``requests`` (``tp_choice.RowRequest``),
        the tokens chosen across the ranks' vocabulary slices."""
        self._check()
        self.busy_since = time.monotonic()
        try:
            _send(("forward", [PlannedStep.of(s) for s in steps], top, requests), self.device)
            local = forward(model, pool, steps)
            logits = self.shard.reduce_logits(local, top)
            chosen = self.shard.choose(local, requests) if requests else None
            self.forwards += 1
            return logits, chosen
        except BaseException as exc:
            fail(f"a tensor-parallel forward failed: {type(exc).__name__}: {exc}")
            raise LOST.error from exc
        finally:
            self.busy_since = None

    def copy_blocks(self, pool, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        self._check()
        try:
            _send(("copy", pairs), self.device)
        except BaseException as exc:
            fail(f"a tensor-parallel block copy failed: {type(exc).__name__}: {exc}")
            raise LOST.error from exc
        pool.copy_blocks(pairs)

    def stop(self) -> None:
        """Tells the other ranks to exit (a normal shutdown)."""
        if LOST.error is None:
            with contextlib.suppress(Exception):
                _send(("stop",), self.device)

    def _check(self) -> None:
        if LOST.error is not None:
            raise LOST.error


# -- failing closed -----------------------------------------------------------------------
@dataclass
class _Lost:
    error: RankLost | None = None
    callbacks: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


LOST = _Lost()


def fail(why: str) -> None:
    """Marks the group lost (once) and tells whoever listens (the app: stop serving, exit)."""
    with LOST.lock:
        if LOST.error is not None:
            return
        LOST.error = RankLost(why)
        callbacks = list(LOST.callbacks)
    log.error("tensor parallelism lost: %s", why)
    for callback in callbacks:
        with contextlib.suppress(Exception):  # e.g. an event loop already closed
            callback(LOST.error)


def on_lost(callback) -> None:
    """Calls ``callback(RankLost)`` once the group is lost (at once if it is already)."""
    with LOST.lock:
        LOST.callbacks.append(callback)
        error = LOST.error
    if error is not None:
        callback(error)


class Watchdog(threading.Thread):
    """Rank 0's guard: a local rank process that exits, or a forward running past
    ``timeout_s`` (a rank that hangs), fails the group (see :func:`fail`)."""

    POLL_S = 0.1

    def __init__(self, procs: list, timeout_s: float):
        super().__init__(name="tp-watchdog", daemon=True)
        self.procs, self.timeout_s = procs, timeout_s
        self.runner: Runner | None = None

    def run(self) -> None:
        while LOST.error is None:
            for rank, proc in enumerate(self.procs, 1):
                if not proc.is_alive():
                    fail(f"rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}")
                    return
            since = self.runner.busy_since if self.runner else None
            if since is not None and time.monotonic() - since > self.timeout_s:
                fail(f"a forward has waited {self.timeout_s:g} s for the other ranks (a rank hangs)")
                return
            time.sleep(self.POLL_S)


# -- processes -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Group:
    """How this process joins: its rank, the degree, where rank 0 listens."""

    rank: int
    degree: int
    master: str  # host:port of torch.distributed's TCP rendezvous
    timeout_s: float = 30.0  # the longest rank 0 waits for the others in one forward

    def backend(self, device: str) -> str:
        return "nccl" if device.startswith("cuda") else "gloo"

    def device(self, device: str) -> torch.device:
        """CUDA: one device per local rank (LOCAL_RANK, as torchrun sets it, else the rank)."""
        if not device.startswith("cuda"):
            return torch.device(device)
        local = int(os.environ.get("LOCAL_RANK", self.rank))
        return torch.device("cuda", local % max(torch.cuda.device_count(), 1))


CURRENT: dict[str, object] = {}  # "group", "watchdog", "procs" in this process once joined


def join(group: Group, device: str) -> None:
    """Joins the process group through torch.distributed's TCP rendezvous."""
    if group.device(device).type == "cuda":
        torch.cuda.set_device(group.device(device))
    dist.init_process_group(group.backend(device), init_method=f"tcp://{group.master}", rank=group.rank,
                            world_size=group.degree, timeout=IDLE_TIMEOUT)
    CURRENT["group"] = group
    log.info("rank %d of %d joined (%s, rendezvous %s)", group.rank, group.degree, group.backend(device),
             group.master)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_local(group: Group, model_path: str, executor_config, threads: int = 0) -> None:
    """Rank 0 on one machine: spawns ranks 1..N-1 (they die with this process), joins
    the group with them and starts the watchdog."""
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, group.degree):
        proc = ctx.Process(target=rank_main, args=(replace(group, rank=rank), model_path, executor_config,
                                                   logging.getLogger().level, os.getpid(), threads),
                           name=f"ferrum-rpc-rank-{rank}", daemon=True)
        proc.start()
        procs.append(proc)
    CURRENT["procs"] = procs
    join(group, executor_config.device)
    watchdog = Watchdog(procs, group.timeout_s)
    CURRENT["watchdog"] = watchdog
    watchdog.start()


def start_remote_watchdog(group: Group) -> None:
    """Rank 0 whose ranks run elsewhere: only the hang guard (a dead remote rank ends
    rank 0's next collective with an error, which fails the group)."""
    watchdog = Watchdog([], group.timeout_s)
    CURRENT["watchdog"] = watchdog
    watchdog.start()


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
    from ..engine.executor import TORCH_DTYPES
    from ..kv.pool import KvPool
    from ..models import load_model

    device = group.device(executor_config.device)
    model = load_model(model_path, TORCH_DTYPES[executor_config.dtype], device, executor_config.linear_kernel,
                       executor_config.quantize, executor_config.step_ops, tp=(group.rank, group.degree))
    shard: Shard = model.tp
    kind, num_blocks, block_size = _receive(device)  # the pool rank 0 sized
    assert kind == "pool", kind
    cfg = shard.local_config()
    pool = KvPool(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                  next(model.parameters()).dtype, device)
    log.info("rank %d serving its shard: KV pool of %d blocks (%.1f MiB)", group.rank, num_blocks,
             pool.nbytes / 2**20)
    while True:
        message = _receive(device)
        if message[0] == "forward":
            _, steps, top, requests = message
            local = forward(model, pool, steps)
            shard.reduce_logits(local, top)
            if requests:
                shard.choose(local, requests)
        elif message[0] == "copy":
            pool.copy_blocks(message[1])
        elif message[0] == "stop":
            log.info("rank %d: stopping", group.rank)
            return
        else:
            raise RuntimeError(f"unknown plan {message[0]!r}")


def send_pool(runner: Runner, num_blocks: int, block_size: int) -> None:
    _send(("pool", num_blocks, block_size), runner.device)


def shutdown() -> None:
    """Rank 0's normal exit (the worker has stopped): tells the ranks to stop and waits a
    little for them."""
    if (runner := CURRENT.get("runner")) is not None:
        runner.stop()
        forwards, shard = max(runner.forwards, 1), runner.shard
        log.info("tensor parallel: %d forwards, %.2f ms a forward in all-reduces, %.2f ms in the LM head's "
                 "reduction, %.0f bytes a forward gathered by the LM head, %d token-choice rows on whole rows",
                 runner.forwards, shard.allreduce_ns / 1e6 / forwards, shard.gather_ns / 1e6 / forwards,
                 shard.lm_head_bytes / forwards, shard.choice_fallback_rows)
    for proc in CURRENT.get("procs", ()):
        proc.join(5)
        if proc.is_alive():
            proc.kill()
    # Before the interpreter exits: left to static destructors, the rendezvous store's
    # thread was destroyed still running about one exit in five ("terminate called
    # without an active exception", SIGABRT, exit status -6 after a clean drain).
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
