"""Batches split by owner (moved, run again, or undone as a whole), session steps and
releases over a replica set, driven by a scripted driver (no process, no model)."""

from __future__ import annotations

import grpc
import pytest

from ferrum_rpc.client.replicas.contract import _Contract
from ferrum_rpc.client.replicas.policy import REPLAY_LOGITS
from ferrum_rpc.errors import ExecutorError, InvalidInput
from ferrum_rpc.types import DecodeInput
from tests.unit.client.script import (
    Call,
    Lost,
    Parallel,
    Script,
    decoded,
    handle,
    prefilled,
    routing,
    serving,
    verified,
)

UNAVAILABLE = ExecutorError("connection reset", code=grpc.StatusCode.UNAVAILABLE)


def two_sequences(**queues):
    """Replicas a and b serving (``queues``: calls queued on each) with s on a and t on b,
    each a prompt of 3 tokens then one decoded token: the routing and the two handles."""
    rs = routing("a", "b")
    for target in ("a", "b"):
        serving(rs, target, queue=queues.get(target, 0))
    for target, cache_id, prompt in (("a", "s", [1, 2, 3]), ("b", "t", [4, 5, 6])):
        seq = rs._fleet.track(next(r for r in rs._fleet.replicas if r.target == target), prompt,
                              handle(target + "1", cache_id, 3))
        rs._fleet.advance(seq, 3, [7], handle(target + "1", cache_id, 4))
    return rs, handle("a1", "s", 4), handle("b1", "t", 4)


def history(rs):
    return {s.handle.cache_id: (s.replica, s.tokens) for s in rs._fleet.live()}


def test_a_batch_runs_one_call_per_owner_and_merges_the_outputs_in_order():
    rs, hs, ht = two_sequences()
    out = Script([Parallel(
        Call("a", "batch_decode", [decoded("a1", "s", 5)], args=([DecodeInput(8, hs)], None)),
        Call("b", "batch_decode", [decoded("b1", "t", 5)], args=([DecodeInput(9, ht)], None)),
    )], rs.clock).run(_Contract.batch_decode(rs, [(9, ht), (8, hs)]))
    assert [o.kv_cache.cache_id for o in out] == ["t", "s"]
    assert history(rs) == {"s": ("a", (1, 2, 3, 7, 8)), "t": ("b", (4, 5, 6, 7, 9))}


def test_a_batch_part_that_fails_for_good_undoes_the_parts_that_ran():
    rs, hs, ht = two_sequences()
    with pytest.raises(InvalidInput):
        Script([
            Parallel(Call("a", "batch_decode", [decoded("a1", "s", 5)]),
                     Call("b", "batch_decode", InvalidInput("token out of range"))),
            Call("a", "truncate_kv", handle("a1", "s", 4), args=(handle("a1", "s", 5), 4)),
        ], rs.clock).run(_Contract.batch_decode(rs, [(8, hs), (9, ht)]))
    assert history(rs) == {"s": ("a", (1, 2, 3, 7)), "t": ("b", (4, 5, 6, 7))}


def test_a_batch_prefill_that_fails_releases_the_sequences_it_created():
    rs, _, ht = two_sequences(b=5)
    with pytest.raises(InvalidInput):
        Script([
            Parallel(Call("a", "batch_prefill", [prefilled("a1", "n", 2)], args=([[1, 9]], None, [None], [""])),
                     Call("b", "batch_prefill", InvalidInput("too long"), args=([([8, 8], ht)], None, [None], [""]))),
            Call("a", "release_cache", 1, args=(handle("a1", "n", 2),)),
        ], rs.clock).run(_Contract.batch_prefill(rs, [[1, 9], ([8, 8], ht)]))
    assert set(history(rs)) == {"s", "t"}


def test_a_batch_part_whose_replica_died_is_replayed_and_run_again_there():
    rs, hs, ht = two_sequences()
    out = Script([
        Parallel(Call("a", "batch_decode", [decoded("a1", "s", 5)]), Call("b", "batch_decode", UNAVAILABLE)),
        Call("a", "prefill", prefilled("a1", "x", 3), args=([4, 5, 6], None, REPLAY_LOGITS)),
        Call("a", "forward_verify", verified("a1", "x", 4)),
        Parallel(Call("a", "batch_decode", [decoded("a1", "x", 5)], args=([DecodeInput(9, handle("a1", "x", 4))],
                                                                           None))),
    ], rs.clock).run(_Contract.batch_decode(rs, [(8, hs), (9, ht)]))
    assert [o.kv_cache.cache_id for o in out] == ["s", "x"]
    assert history(rs) == {"s": ("a", (1, 2, 3, 7, 8)), "x": ("a", (4, 5, 6, 7, 9))}


def test_a_session_step_drops_the_stream_to_a_lost_replica_before_moving_its_sequences():
    rs, hs, ht = two_sequences()
    out = Script([
        Parallel(Call("a", "step", [decoded("a1", "s", 5)], stream=True),
                 Call("b", "step", UNAVAILABLE, stream=True)),
        Lost("b"),
        Call("a", "prefill", prefilled("a1", "x", 3)),
        Call("a", "forward_verify", verified("a1", "x", 4)),
        Parallel(Call("a", "step", [decoded("a1", "x", 5)], stream=True)),
    ], rs.clock).run(rs.batches.step_flow([(8, hs), (9, ht)]))
    assert [o.kv_cache.cache_id for o in out] == ["s", "x"]


def test_release_by_request_id_asks_every_replica_and_skips_the_unreachable():
    rs = routing("a", "b", "c")
    assert Script([
        Call("a", "release_cache", 2, args=(None, "req-1")),
        Call("b", "release_cache", UNAVAILABLE),
        Call("c", "release_cache", 3, args=(None, "req-1")),
    ], rs.clock).run(_Contract.release_cache(rs, request_id="req-1")) == 5
    with pytest.raises(InvalidInput):
        Script([Call("a", "release_cache", InvalidInput("bad name"))], rs.clock).run(
            _Contract.release_cache(rs, request_id="?"))


def test_releasing_a_sequence_whose_replica_is_gone_frees_nothing_and_forgets_it():
    rs, hs, _ = two_sequences()
    assert Script([Call("a", "release_cache", UNAVAILABLE, args=(hs,))], rs.clock).run(
        _Contract.release_cache(rs, hs)) == 0
    assert set(history(rs)) == {"t"}


def test_a_bare_cache_id_is_released_by_whichever_replica_has_it():
    rs = routing("a", "b")
    assert Script([
        Call("a", "release_cache", ExecutorError("no such cache", code=grpc.StatusCode.NOT_FOUND)),
        Call("b", "release_cache", 4, args=("zz",)),
    ], rs.clock).run(_Contract.release_cache(rs, "zz")) == 4
