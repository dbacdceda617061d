"""Calls on one sequence and its failover (replay, migration, resync, the move to a
decode replica), driven by a scripted driver (no process, no model)."""

from __future__ import annotations

import grpc
import pytest

from ferrum_rpc.client.replicas.contract import _Contract
from ferrum_rpc.client.replicas.policy import REPLAY_LOGITS
from ferrum_rpc.errors import DeadlineExceeded, Draining, ExecutorError, LengthMismatch, StaleHandle
from ferrum_rpc.types import SequencePush
from ferrum_rpc.v1 import executor_pb2 as pb
from tests.unit.client.script import (
    Call,
    Parallel,
    Script,
    capabilities,
    decoded,
    handle,
    prefilled,
    routing,
    serving,
    status,
    verified,
)

UNAVAILABLE = ExecutorError("connection reset", code=grpc.StatusCode.UNAVAILABLE)


def replica(rs, target):
    return next(r for r in rs._fleet.replicas if r.target == target)


def a_sequence_on_a(failover: bool = True, **policy):
    """Replicas a and b serving (a the less loaded) and a sequence on a: the prompt
    [1, 2, 3] then the decoded token 7.  The routing and the sequence's handle (length 4)."""
    rs = routing("a", "b", failover=failover, **policy)
    serving(rs, "a", queue=0)
    serving(rs, "b", queue=1)
    return rs, prompted_and_decoded(rs)


def prompted_and_decoded(rs):
    """A sequence on a: the prompt [1, 2, 3] then the decoded token 7; its handle (length 4)."""
    Script([Call("a", "prefill", prefilled("a1", "s", 3)),
            Call("a", "decode", decoded("a1", "s", 4), args=(7, handle("a1", "s", 3), None, None))],
           rs.clock).run(_run_both(rs))
    return handle("a1", "s", 4)


def _run_both(rs):
    out = yield from _Contract.prefill(rs, [1, 2, 3])
    yield from _Contract.decode(rs, 7, out.kv_cache)


def replayed_on(target, cache_id, instance=None):
    """The calls that rebuild the sequence on ``target``: its prompt as a Prefill, the
    decoded token as a ForwardVerify (output), neither asking for logits."""
    instance = instance or target + "1"
    return [Call(target, "prefill", prefilled(instance, cache_id, 3), args=([1, 2, 3], None, REPLAY_LOGITS)),
            Call(target, "forward_verify", verified(instance, cache_id, 4),
                 args=([7], handle(instance, cache_id, 3), REPLAY_LOGITS))]


def test_a_decode_whose_owner_died_is_replayed_elsewhere_and_goes_on_there():
    rs, old = a_sequence_on_a()
    out = Script([
        Call("a", "decode", UNAVAILABLE),
        *replayed_on("b", "x"),
        Call("b", "decode", decoded("b1", "x", 5), args=(8, handle("b1", "x", 4), None, None)),
    ], rs.clock).run(_Contract.decode(rs, 8, old))
    assert out.kv_cache == handle("b1", "x", 5)
    (seq,) = rs._fleet.live()
    assert (seq.replica, seq.tokens, seq.prompt_spans) == ("b", (1, 2, 3, 7, 8), ((0, 3),))
    assert rs._fleet.resolve(old)[1] == handle("b1", "x", 4)  # the old handle is an alias of the new one
    assert not replica(rs, "a").healthy


def test_a_restarted_owner_is_asked_again_and_may_take_its_sequence_back_by_a_replay():
    rs, old = a_sequence_on_a()
    out = Script([
        Call("a", "decode", StaleHandle("a new server instance")),
        Parallel(Call("a", "_status_probe", status("a2", queue=0))),  # asked again, not left out
        Call("a", "capabilities", capabilities()),
        *replayed_on("a", "x", "a2"),
        Call("a", "decode", decoded("a2", "x", 5), args=(8, handle("a2", "x", 4), None, None)),
    ], rs.clock).run(_Contract.decode(rs, 8, old))
    assert out.kv_cache.server_instance_id == "a2" and replica(rs, "a").healthy


@pytest.mark.parametrize("moved", [True, False])
def test_a_draining_owner_pushes_the_sequence_and_a_push_that_did_not_move_it_falls_back_to_a_replay(moved):
    rs, old = a_sequence_on_a()
    pushed = [Call("b", "create_import_ticket", pb.ImportTicket(ticket="t1")),
              Call("a", "push_sequence", SequencePush(handle("b1", "m", 4), 4096, moved),
                   args=(handle("a1", "s", 4), "b", "t1", True))]
    if moved:
        then = [Call("b", "decode", decoded("b1", "m", 5), args=(8, handle("b1", "m", 4), None, None))]
    else:  # the copy it made is not the sequence: released, and the sequence replayed
        then = [Call("b", "release_cache", 1, args=(handle("b1", "m", 4),)), *replayed_on("b", "x"),
                Call("b", "decode", decoded("b1", "x", 5), args=(8, handle("b1", "x", 4), None, None))]
    Script([Call("a", "decode", Draining("stopping")), *pushed, *then], rs.clock).run(_Contract.decode(rs, 8, old))
    assert rs._fleet.live()[0].replica == "b"


def test_a_call_that_timed_out_but_ran_is_resynced_from_the_history_on_the_replica_it_was_on():
    rs = routing("a", "b")
    serving(rs, "a", queue=0)
    serving(rs, "b", queue=5)
    old = prompted_and_decoded(rs)
    with pytest.raises(DeadlineExceeded):  # the caller sees its timeout; the sequence is now unsure
        Script([Call("a", "decode", DeadlineExceeded("late"))], rs.clock).run(_Contract.decode(rs, 8, old))
    Script([
        Call("a", "decode", LengthMismatch("the server holds 5 tokens")),
        *replayed_on("a", "z"),  # any replica may rebuild it, its own included (a is the less loaded)
        Call("a", "release_cache", 1, args=(handle("a1", "s", 4),)),  # the copy of unknown length
        Call("a", "decode", decoded("a1", "z", 5), args=(8, handle("a1", "z", 4), None, None)),
    ], rs.clock).run(_Contract.decode(rs, 8, old))
    assert rs._fleet.live()[0].tokens == (1, 2, 3, 7, 8)


def test_without_failover_the_owners_error_reaches_the_caller_and_the_sequence_stays():
    rs, old = a_sequence_on_a(failover=False)
    with pytest.raises(ExecutorError) as err:
        Script([Call("a", "decode", UNAVAILABLE)], rs.clock).run(_Contract.decode(rs, 8, old))
    assert err.value is UNAVAILABLE and rs._fleet.live()[0].replica == "a"


def test_a_replay_that_fails_on_every_replica_ends_in_failover_failed_with_the_copies_released():
    rs, old = a_sequence_on_a(max_attempts=2)
    with pytest.raises(ExecutorError, match="could not move sequence"):
        Script([
            Call("a", "decode", UNAVAILABLE),
            Call("b", "prefill", prefilled("b1", "x", 3)),
            Call("b", "forward_verify", ExecutorError("bad", code=grpc.StatusCode.INTERNAL)),
            Call("b", "release_cache", 1, args=(handle("b1", "x", 3),)),  # the half-built copy
        ], rs.clock).run(_Contract.decode(rs, 8, old))


def test_a_sequence_moves_from_its_prefill_replica_to_a_decode_replica_before_it_decodes():
    rs = routing("a", "b", roles={"a": "prefill", "b": "decode"})
    serving(rs, "a", queue=3)
    serving(rs, "b", queue=0)
    out = Script([Call("a", "prefill", prefilled("a1", "s", 3))], rs.clock).run(_Contract.prefill(rs, [1, 2, 3]))
    Script([
        Call("b", "create_import_ticket", pb.ImportTicket(ticket="t1")),
        Call("a", "push_sequence", SequencePush(handle("b1", "m", 3), 4096, True)),
        Call("b", "decode", decoded("b1", "m", 4), args=(7, handle("b1", "m", 3), None, None)),
        Call("b", "decode", decoded("b1", "m", 5)),  # moved once: the next step stays on b
    ], rs.clock).run(_decode_twice(rs, out.kv_cache))


def _decode_twice(rs, kv):
    out = yield from _Contract.decode(rs, 7, kv)
    yield from _Contract.decode(rs, 8, out.kv_cache)


def test_a_fork_tracks_each_child_with_its_parents_history():
    rs = routing("a")
    serving(rs)
    old = prompted_and_decoded(rs)
    children = [handle("a1", "c1", 4), handle("a1", "c2", 4)]
    assert Script([Call("a", "fork_cache", children, args=(old, 2))], rs.clock).run(
        _Contract.fork_cache(rs, old, 2)) == children
    live = {s.handle.cache_id: s.tokens for s in rs._fleet.live()}
    assert live == {"s": (1, 2, 3, 7), "c1": (1, 2, 3, 7), "c2": (1, 2, 3, 7)}
