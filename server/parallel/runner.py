"""Rank 0's side of a tensor-parallel forward: each plan is broadcast to the other
ranks, every rank runs the same forward over its shard, and the LM head's rows and
token choices are reduced (see ``shard.py``).  The forward itself is the engine's,
handed in: this room runs plans, it does not make them."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ferrum_rpc.errors import Cancelled
from ..choice.rows import ChosenTokens
from .group import CURRENT, LOST, fail
from .shard import Shard

log = logging.getLogger(__name__)


@dataclass
class PlannedStep:
    """A step as the other ranks see it: what ``forward.forward`` reads, nothing more."""

    tokens: list[int]
    start: int
    block_ids: list[int]
    rows: object  # engine.forward.Rows: which rows go through the LM head
    hidden: dict[int, None] | None = None
    attention: dict[int, None] | None = None
    heads: tuple[int, ...] = ()
    adapter: str = ""  # adapters are not served sharded: always the base model

    @classmethod
    def of(cls, step) -> PlannedStep:
        return cls(list(step.tokens), step.start, list(step.block_ids), step.rows,
                   dict.fromkeys(step.hidden) if step.hidden else None,
                   dict.fromkeys(step.attention) if step.attention else None, tuple(step.heads))


def _send(message: tuple, device: torch.device) -> None:
    dist.broadcast_object_list([message], src=0, device=device if device.type == "cuda" else None)


def receive(device: torch.device) -> tuple:
    box = [None]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    return box[0]


class Runner:
    """Rank 0's side: broadcasts each plan, runs its own shard, reduces the logits.

    Any failure inside a forward (a collective that errs because a rank died, an
    error on this rank that would leave the others waiting) fails the group for
    good: the ranks can no longer be trusted to be in step, so nothing is served
    again (see :func:`fail`)."""

    def __init__(self, shard: Shard, device: torch.device, run: Callable):
        self.shard, self.device, self.run = shard, device, run  # run(model, pool, steps): the forward
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
            local = self.run(model, pool, steps)
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

    def update(self, tensors: dict[str, torch.Tensor], build: Callable, gone: Callable[[], bool]):
        """An UpdateWeights on every rank: the whole tensors go to every rank, each builds
        its shard of the new model with its slices (``build(tensors)``), and all switch to
        it or none does (:func:`agree`): a rank that could not build, or a caller that
        went away, leaves every rank on the old weights.  Returns rank 0's new model.
        The watchdog bounds the broadcast, and the wait for the other ranks once this
        rank has built its shard (as it bounds a forward), not this rank's own build."""
        self._check()
        try:
            self.busy_since = time.monotonic()
            _send(("update", [(name, t.shape, t.dtype) for name, t in tensors.items()]), self.device)
            share_tensors(tensors, self.device)
            self.busy_since = None
            model, why = _built(build, tensors)
            self.busy_since = time.monotonic()
            if not agree(model is not None, self.device):
                raise_after = RuntimeError(f"{why or 'a rank could not build its shard'}: the old weights still "
                                           "serve on every rank")
            else:
                switch = not gone()
                _send(("switch", switch), self.device)
                raise_after = None if switch else Cancelled("the caller cancelled the update; the old weights "
                                                            "still serve on every rank")
        except BaseException as exc:
            fail(f"a tensor-parallel weights update failed: {type(exc).__name__}: {exc}")
            raise LOST.error from exc
        finally:
            self.busy_since = None
        if raise_after is not None:
            raise raise_after
        return model

    def stop(self) -> None:
        """Tells the other ranks to exit (a normal shutdown)."""
        if LOST.error is None:
            with contextlib.suppress(Exception):
                _send(("stop",), self.device)

    def _check(self) -> None:
        if LOST.error is not None:
            raise LOST.error




def share_tensors(tensors: dict[str, torch.Tensor], device: torch.device) -> None:
    """Broadcasts rank 0's tensors (filled in place on the other ranks), as their bytes."""
    for tensor in tensors.values():
        data = tensor.reshape(-1).view(torch.uint8)
        moved = data.to(device)
        dist.broadcast(moved, src=0)
        if moved.data_ptr() != data.data_ptr():
            data.copy_(moved.cpu())


def _built(build: Callable, tensors: dict[str, torch.Tensor]):
    """(the model ``build`` made, None) or (None, why it could not)."""
    try:
        return build(tensors), None
    except Exception as exc:  # told to every rank by agree(); the old model stays
        log.exception("building the updated shard failed")
        return None, f"building the new weights failed ({type(exc).__name__}: {exc})"


def agree(ok: bool, device: torch.device) -> bool:
    """Whether every rank's ``ok`` is true (a MIN all-reduce)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def follow_update(specs: list, model, build: Callable, device: torch.device):
    """A rank other than 0's side of :meth:`Runner.update`: the model it serves next."""
    tensors = {name: torch.empty(shape, dtype=dtype) for name, shape, dtype in specs}
    share_tensors(tensors, device)
    new, _ = _built(build, tensors)
    if not agree(new is not None, device):
        return model
    kind, switch = receive(device)
    assert kind == "switch", kind
    return new if switch else model


def send_pool(runner: Runner, num_blocks: int, block_size: int) -> None:
    _send(("pool", num_blocks, block_size), runner.device)


