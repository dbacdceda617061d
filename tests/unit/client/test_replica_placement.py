"""Placement of new sequences over a replica set, its retries and bounds, driven by a
scripted driver (no process, no model): each test lists the calls the flow must make."""

from __future__ import annotations

import grpc
import pytest

from ferrum_rpc.client.replicas.contract import _Contract
from ferrum_rpc.errors import AdapterNotFound, Draining, ExecutorError, FailoverFailed, InvalidInput
from tests.unit.client.script import (
    Call,
    Parallel,
    Script,
    ScriptError,
    Sleep,
    capabilities,
    prefilled,
    routing,
    serving,
    status,
)

UNAVAILABLE = ExecutorError("connection refused", code=grpc.StatusCode.UNAVAILABLE)


def replica(rs, target):
    return next(r for r in rs._fleet.replicas if r.target == target)


def test_a_new_prompt_goes_to_the_less_loaded_replica_after_probing_stale_statuses():
    rs = routing("a", "b")
    for r in rs._fleet.replicas:  # known instances whose status is stale: a probe, no capabilities call
        r.instance_id, r.block_size = r.target + "1", 4
    out = Script([
        Parallel(Call("a", "_status_probe", status("a1", queue=3), args=(2.0,)),
                 Call("b", "_status_probe", status("b1", queue=0), args=(2.0,))),
        Call("b", "prefill", prefilled("b1", "s", 3), args=([1, 2, 3], None, None, None, None, None, "")),
    ], rs.clock).run(_Contract.prefill(rs, [1, 2, 3]))
    assert out.kv_cache.cache_id == "s"
    (seq,) = rs._fleet.live()
    assert (seq.replica, seq.tokens, seq.prompt_spans) == ("b", (1, 2, 3), ((0, 3),))


def test_a_new_instance_is_asked_its_capabilities_before_it_takes_work():
    rs = routing("a")
    Script([
        Parallel(Call("a", "_status_probe", status("a7"))),
        Call("a", "capabilities", capabilities(block_size=16)),
        Call("a", "prefill", prefilled("a7", "s", 2)),
    ], rs.clock).run(_Contract.prefill(rs, [5, 6]))
    a = replica(rs, "a")
    assert (a.instance_id, a.block_size, a.placed_tokens) == ("a7", 16, 2)


@pytest.mark.parametrize("queued, chosen", [(1, "a"), (3, "b")])
def test_the_prefix_replica_is_taken_unless_it_is_busier_than_the_slack(queued, chosen):
    rs = routing("a", "b", prefix_tokens=4, locality_slack=2.0)
    serving(rs)
    replica(rs, "b").unusable_until = rs.clock() + 5  # the first prompt can only go to a
    Script([Call("a", "prefill", prefilled("a1", "s", 6))], rs.clock).run(_Contract.prefill(rs, [1, 2, 3, 4, 5, 6]))
    rs.clock.now += 10
    serving(rs, "a", queue=queued)
    serving(rs, "b", queue=0)
    # Same first 4 tokens: a holds the prefix, and is taken while its load is within 2 of b's.
    Script([Call(chosen, "prefill", prefilled(chosen + "1", "t", 5))], rs.clock).run(
        _Contract.prefill(rs, [1, 2, 3, 4, 9]))


def test_a_draining_replica_is_left_out_and_the_prompt_placed_on_the_next():
    rs = routing("a", "b")
    serving(rs, "a", queue=0)
    serving(rs, "b", queue=1)
    out = Script([
        Call("a", "prefill", Draining("stopping")),
        Call("b", "prefill", prefilled("b1", "s", 3)),
    ], rs.clock).run(_Contract.prefill(rs, [1, 2, 3]))
    assert out.kv_cache.server_instance_id == "b1"
    a = replica(rs, "a")
    assert not a.healthy and a.unusable_until == rs.clock() + rs.policy.down_cooldown_s


def test_a_replica_without_the_prompts_adapter_is_passed_over_and_stays_healthy():
    rs = routing("a", "b")
    serving(rs, "a", queue=0)
    serving(rs, "b", queue=1)
    out = Script([
        Call("a", "prefill", AdapterNotFound("no adapter 'x'"), args=([1, 2, 3], None, None, None, None, None, "x")),
        Call("b", "prefill", prefilled("b1", "s", 3), args=([1, 2, 3], None, None, None, None, None, "x")),
    ], rs.clock).run(_Contract.prefill(rs, [1, 2, 3], adapter="x"))
    assert out.kv_cache.server_instance_id == "b1"
    assert replica(rs, "a").healthy  # lacking an adapter is no outage


def test_an_error_that_is_not_the_replicas_fault_reaches_the_caller_untried_elsewhere():
    rs = routing("a", "b")
    serving(rs, "a", queue=0)
    serving(rs, "b", queue=1)
    with pytest.raises(InvalidInput):
        Script([Call("a", "prefill", InvalidInput("token out of range"))], rs.clock).run(
            _Contract.prefill(rs, [1, 2, 3]))
    assert replica(rs, "a").healthy and not rs._fleet.live()


def test_with_no_replica_usable_placement_waits_out_cooldowns_then_fails_within_its_bounds():
    rs = routing("a", "b", max_attempts=3)
    for r in rs._fleet.replicas:
        rs.placement.mark(r, UNAVAILABLE)  # left out for the cooldown (1 s), then probed again
    script = Script([
        Sleep(1.0),
        Parallel(Call("a", "_status_probe", UNAVAILABLE), Call("b", "_status_probe", UNAVAILABLE)),
        Sleep(1.0),
        Parallel(Call("a", "_status_probe", UNAVAILABLE), Call("b", "_status_probe", UNAVAILABLE)),
    ], rs.clock)
    with pytest.raises(FailoverFailed) as failed:
        script.run(_Contract.prefill(rs, [1, 2, 3]))
    assert failed.value.attempts == 3 and not script.steps


def test_without_failover_a_prompt_goes_to_the_replica_back_soonest_and_its_error_to_the_caller():
    rs = routing("a", "b", failover=False)
    serving(rs)
    replica(rs, "a").unusable_until = rs.clock() + 5
    replica(rs, "b").unusable_until = rs.clock() + 3
    with pytest.raises(ExecutorError) as err:
        Script([Call("b", "prefill", UNAVAILABLE)], rs.clock).run(_Contract.prefill(rs, [1, 2]))
    assert err.value is UNAVAILABLE


def test_queries_go_to_the_first_replica_that_answers():
    rs = routing("a", "b")
    replica(rs, "a").unusable_until = rs.clock() + 5  # left out: asked last
    assert Script([Call("b", "info", UNAVAILABLE), Call("a", "info", "the info")], rs.clock).run(
        _Contract.info(rs)) == "the info"


# -- the scripted driver itself fails a test that goes wrong ------------------------------------


def test_the_script_fails_on_a_call_it_did_not_expect():
    rs = routing("a", "b")
    serving(rs, "a", queue=0)
    serving(rs, "b", queue=5)
    with pytest.raises(ScriptError, match="expected b.prefill"):
        Script([Call("b", "prefill", prefilled("b1", "s", 1))], rs.clock).run(_Contract.prefill(rs, [1]))


def test_the_script_fails_on_wrong_arguments_and_on_steps_left_over():
    rs = routing("a")
    serving(rs)
    with pytest.raises(ScriptError, match="expected args"):
        Script([Call("a", "prefill", prefilled("a1", "s", 1), args=([2], None, None, None, None, None, ""))],
               rs.clock).run(_Contract.prefill(rs, [1]))
    with pytest.raises(ScriptError, match="not taken"):
        Script([Call("a", "prefill", prefilled("a1", "t", 1)), Call("a", "decode", None)], rs.clock).run(
            _Contract.prefill(rs, [1]))
