"""Batches over a replica set: BatchDecode, BatchPrefill and DecodeSession steps.

A batch's entries are routed (a handle to its owner, a new prompt where placement
puts it), run as one call per replica in parallel and merged back in request
order.  A group whose replica cannot hold its sequences is moved (replayed, or its
new prompts placed again) and run again; if any group fails for good, the groups
that succeeded are undone (truncated back, new sequences released), so a failed
batch changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import grpc

from .actions import Flow, _Call, _Lost, _Parallel
from .policy import moves_sequence
from ..disagg import PREFILL
from ..fleet import _Replica, _Sequence
from ..rpc import DecodeItem, Prompt, split_prompt
from ferrum_rpc.errors import ExecutorError, FailoverFailed, Reason
from ferrum_rpc.types import DecodeInput, KvCacheHandle, LogitsPolicy, TokenChoice

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Item:
    """One entry of a split batch: what it adds, the sequence it continues (None: a
    new prompt, or a handle this client does not track) and where it goes."""

    index: int
    tokens: list[int]
    seq: _Sequence | None
    send: KvCacheHandle | None
    replica: _Replica | None
    before: int = 0
    created: bool = False  # a new sequence made by this call (undone by releasing it)
    prompt: bool = False  # what it adds is prompt (a BatchPrefill), not output


class Batches:
    """Split batches as flows (part of :class:`~.routing._Routing`; placement and moves
    come from :class:`~.placement.Placement` and :class:`~.failover.Failover`)."""

    def __init__(self, routing):
        self.r = routing  # the state the flows read and change

    def items_flow(self, entries: Iterable[tuple[Sequence[int], KvCacheHandle | None]],
                    prompt: bool = False) -> Flow:
        """Batch entries -> items with their replica: a handle goes to its owner, a new
        prompt where placement puts it."""
        items = []
        for index, (tokens, handle) in enumerate(entries):
            tokens = list(tokens)
            if handle is None:
                replica = yield from self.r.placement.place_flow(tokens, role=PREFILL)
                if replica is None:
                    replica = min(self.r._fleet.replicas, key=lambda r: r.unusable_until)
                items.append(_Item(index, tokens, None, None, replica, prompt=prompt))
                continue
            seq, send = self.r._fleet.resolve(handle)
            if seq is not None and not prompt:
                send = yield from self.r._roles.handoff_flow(self.r.placement.place_flow, self.r.failovers.migrate_flow, seq, send)
            replica = seq.replica if seq is not None else (yield from self.r.placement.owner_flow(handle))
            items.append(_Item(index, tokens, seq, send, replica, before=send.sequence_length, prompt=prompt))
        return items

    def batch_flow(self, entries, call_for: Callable[[_Replica, list[_Item]], _Call], prompt: bool = False) -> Flow:
        """A batch's entries placed or routed, then run split by replica (``_grouped_flow``);
        ``prompt``: the entries add prompt tokens (a BatchPrefill)."""
        items = yield from self.items_flow(entries, prompt)
        return (yield from self.grouped_flow(items, call_for))

    def step_flow(self, items: Iterable[DecodeItem], logits: LogitsPolicy | None = None,
                   token_choice: TokenChoice | None = None) -> Flow:
        """One DecodeSession step: split by owner, one stream step per replica in parallel
        (calls on each replica's stream, which the session driver holds), merged in order."""
        items = list(items)
        choices = _item_choices(items, token_choice)

        def call_for(replica, group):
            return _Call(replica, "step", ([DecodeInput(i.tokens[0], i.send, choices[i.index]) for i in group],
                                           logits), stream=True)
        return (yield from self.batch_flow(_entries(items), call_for))

    def grouped_flow(self, items: list[_Item], call_for: Callable[[_Replica, list[_Item]], _Call]) -> Flow:
        """Runs a batch split by replica, the groups in parallel, and returns the outputs
        in the items' order.  A group whose replica cannot hold its sequences is moved
        (replayed, or new prompts placed again) and run again (its stream, for a session
        step, dropped first: :class:`~.actions._Lost`); if any group fails for good, the
        groups that succeeded are undone (truncated back, new sequences released), so
        the call as a whole changes nothing."""
        outputs: list[Any] = [None] * len(items)
        done: list[_Item] = []
        pending = items
        try:
            for round_ in range(self.r.policy.max_attempts + 1):
                groups: dict[_Replica, list[_Item]] = {}
                for item in pending:
                    groups.setdefault(item.replica, []).append(item)
                calls = [call_for(replica, group) for replica, group in groups.items()]
                results = yield _Parallel(calls)
                retry, failure = [], None
                for (replica, group), call, result in zip(groups.items(), calls, results):
                    if not isinstance(result, ExecutorError):
                        for item, out in zip(group, result):
                            outputs[item.index] = out
                            self.commit(item, out)
                            done.append(item)
                    elif failure is None and self.movable(group, result) and round_ < self.r.policy.max_attempts:
                        self.r.placement.mark(replica, result)
                        if call.stream:
                            yield _Lost(replica)
                        retry.extend((item, result) for item in group)
                    elif failure is None and self.r.failover and round_ < self.r.policy.max_attempts and any(
                            self.r.failovers.resyncs(item.seq, result) for item in group):
                        retry.extend((item, result) for item in group)  # the unsure ones are rebuilt
                    else:
                        if result.code is grpc.StatusCode.DEADLINE_EXCEEDED:
                            for item in group:
                                if item.seq is not None:
                                    item.seq.unsure = True  # it may have run after all: the next call checks
                        failure = failure or result
                if failure is not None:
                    raise failure
                if not retry:
                    return outputs
                for item, cause in retry:
                    yield from self.relocate_flow(item, cause)
                pending = [item for item, _ in retry]
        except ExecutorError:
            yield from self.undo_flow(done)
            raise
        raise AssertionError("unreachable")

    def movable(self, group: list[_Item], err: ExecutorError) -> bool:
        return self.r.failover and moves_sequence(err) and all(
            item.seq is not None and item.seq.tokens or item.send is None for item in group)

    def relocate_flow(self, item: _Item, cause: ExecutorError) -> Flow:
        if cause.reason is Reason.LENGTH_MISMATCH:  # a resync: only the sequences a timeout left unsure
            if self.r.failovers.resyncs(item.seq, cause):
                item.send = yield from self.r.failovers.resync_flow(item.seq, item.send, cause)
                item.replica = item.seq.replica
            return
        if item.seq is None:  # a new prompt: place it again, elsewhere
            replica = yield from self.r.placement.place_flow(item.tokens, {item.replica}, PREFILL)
            if replica is None:
                raise FailoverFailed(f"could not place a new sequence: no replica usable ({cause})", cause=cause)
            item.replica = replica
            return
        item.send = yield from self.r.failovers.replay_flow(item.seq, item.send, cause)
        item.replica = item.seq.replica

    def commit(self, item: _Item, out: Any) -> None:
        if item.send is None:
            item.seq, item.created = self.r._fleet.track(item.replica, item.tokens, out.kv_cache), True
            self.r._fleet.remember_prefix(item.tokens, item.replica)
        elif item.seq is not None:
            self.r._fleet.advance(item.seq, item.before, item.tokens, out.kv_cache, item.prompt)

    def undo_flow(self, done: list[_Item]) -> Flow:
        """Takes back what the succeeded part of a failed batch did (best effort, logged)."""
        for item in done:
            seq = item.seq
            try:
                if item.created:
                    yield _Call(seq.replica, "release_cache", (seq.handle,))
                    self.r._fleet.forget(seq)
                elif seq is not None:
                    handle = yield _Call(seq.replica, "truncate_kv", (seq.handle, item.before))
                    self.r._fleet.advance(seq, item.before, (), handle)
            except ExecutorError as err:
                log.warning("could not undo the part of a failed batch on %s: %s", seq.replica.target, err)


def _entries(items: Iterable[DecodeItem]) -> list[tuple[list[int], KvCacheHandle]]:
    pairs = [(i.token_id, i.kv_cache) if isinstance(i, DecodeInput) else i for i in items]
    return [([token], handle) for token, handle in pairs]


def _prompt_entries(prompts: Iterable[Prompt]) -> list[tuple[list[int], KvCacheHandle | None]]:
    return [(list(tokens), handle) for tokens, handle in map(split_prompt, prompts)]


def _item_choices(items: list, token_choice: TokenChoice | None) -> list[TokenChoice | None]:
    """Each decode item's token choice: its own (DecodeInput.token_choice), else ``token_choice``."""
    return [i.token_choice if isinstance(i, DecodeInput) and i.token_choice is not None else token_choice
            for i in items]


def _prompt_choices(count: int, token_choice) -> list[TokenChoice | None]:
    """batch_prefill's ``token_choice``: one for every prompt, or one per prompt."""
    if token_choice is None or isinstance(token_choice, TokenChoice):
        return [token_choice] * count
    choices = list(token_choice)
    if len(choices) != count:
        raise ValueError(f"{len(choices)} token choices for {count} prompts")
    return choices
