"""The scheduling policy on its own (server/engine/policy.py): no model, no threads."""

from __future__ import annotations

import itertools

from ferrum_rpc.server.engine.policy import (
    Kind,
    Limits,
    Queued,
    fair,
    prompt_room,
    still_waiting_for,
    take_decodes,
    take_prompts,
)

LIMITS = Limits(max_batch=4, step_token_budget=128, prefill_chunk=256)
_keys = itertools.count(1)


def decode(tenant="a", *seqs):
    return Queued(next(_keys), Kind.DECODE, tenant, tuple(seqs) or (f"s{next(_keys)}",))


def prompt(tenant="a", remaining=100, continues=None, started=False, blocks=0, patient=True, must_run=False,
           analysis=False):
    return Queued(next(_keys), Kind.PROMPT, tenant, (continues,) if continues else (), remaining=remaining,
                  started=started, blocks_to_finish=blocks, patient=patient, must_run=must_run, analysis=analysis)


def other():
    return Queued(next(_keys), Kind.OTHER)


# -- decodes ------------------------------------------------------------------------
def test_decodes_are_shared_round_robin_across_tenants():
    queue = [decode("a") for _ in range(40)] + [decode("b")]
    taken, closed = take_decodes(queue, [], LIMITS)
    assert [q.tenant for q in taken] == ["a", "b", "a", "a"]  # b's one decode rides the first forward
    assert closed


def test_a_decode_never_overtakes_another_kind_of_job():
    first, release, late = decode("a"), other(), decode("b")
    taken, closed = take_decodes([first, release, late], [], LIMITS)
    assert taken == [first] and closed


def test_a_decode_waits_for_a_prompt_queued_ahead_on_its_sequence():
    cont = prompt("a", continues="x")
    blocked, free = decode("a", "x"), decode("b", "y")
    taken, _ = take_decodes([cont, blocked, free], [], LIMITS)
    assert taken == [free]


def test_a_sequence_is_never_in_a_forward_twice_and_the_batch_cap_holds():
    one, again, wide, fits = decode("a", "x"), decode("b", "x"), decode("c", "p", "q", "r", "s"), decode("d", "z")
    taken, closed = take_decodes([one, again, wide, fits], [], LIMITS)
    assert taken == [one, fits] and closed
    taken, closed = take_decodes([decode("a")], [decode("a", "1", "2", "3", "4")], LIMITS)
    assert taken == [] and closed


def test_with_no_budget_decodes_do_not_reach_past_a_prompt():
    separate = Limits(max_batch=4, step_token_budget=0, prefill_chunk=256)
    head, p, behind = decode("a"), prompt("a"), decode("b")
    assert take_decodes([head, p, behind], [], separate)[0] == [head]
    assert take_decodes([head, p, behind], [], LIMITS)[0] == [head, behind]  # the unified forward does


# -- prompts ------------------------------------------------------------------------
def test_the_budget_sets_the_room():
    assert prompt_room(LIMITS, decode_rows=10, decoders_active=True) == 118
    assert prompt_room(LIMITS, decode_rows=127, decoders_active=True) == 32  # a quarter is always the prompts'
    assert prompt_room(LIMITS, decode_rows=0, decoders_active=True) == 128  # decoders are on their way back
    assert prompt_room(LIMITS, decode_rows=0, decoders_active=False) == 256  # whole chunks
    separate = Limits(max_batch=4, step_token_budget=0, prefill_chunk=256)
    assert prompt_room(separate, 3, True) == 0 and prompt_room(separate, 0, True) == 256


def test_prompt_parts_fill_the_room_in_chunks():
    a, b, c = prompt("a", 100), prompt("a", 500), prompt("a", 50)
    plan = take_prompts([a, b, c], [], LIMITS, room=300, free_blocks=10_000, turns={})
    assert plan.parts == [(a.key, 100), (b.key, 200)] and plan.parked == []


def test_prompts_are_shared_round_robin_across_tenants():
    alice = [prompt("alice", 250) for _ in range(12)]
    bob = prompt("bob", 10)
    plan = take_prompts([*alice, bob], [], LIMITS, room=64, free_blocks=10_000, turns={"alice": 5})
    assert plan.parts[0] == (bob.key, 10)  # served longest ago (never): first
    carol = prompt("carol")
    assert fair([*alice[:2], bob, carol], {"bob": 1, "alice": 2})[:3] == [carol, bob, alice[0]]
    order = fair([*alice[:3], bob], {})
    assert [q.tenant for q in order] == ["alice", "bob", "alice", "alice"]


def test_a_sequence_gets_one_part_a_forward_and_analysis_prompts_run_alone():
    d = decode("a", "x")
    cont = prompt("a", 20, continues="x")
    same = [prompt("a", 20, continues="y"), prompt("a", 20, continues="y")]
    analysis = prompt("a", 20, analysis=True)
    plan = take_prompts([cont, *same, analysis], [d], LIMITS, room=100, free_blocks=10_000, turns={})
    assert plan.parts == [(same[0].key, 20)]


def test_admission_parks_what_the_pool_cannot_hold_beside_started_prompts():
    running = prompt("a", 100, started=True, blocks=30)
    big, small = prompt("a", 200, blocks=50), prompt("b", 10, blocks=3)
    plan = take_prompts([running, big, small], [], LIMITS, room=1000, free_blocks=60, turns={})
    assert (running.key, 100) in plan.parts and (small.key, 10) in plan.parts
    assert plan.parked == [big.key]
    # nothing started: a patient prompt still waits; one out of patience, or whose caller left, runs
    assert take_prompts([big], [], LIMITS, 1000, 20, {}).parked == [big.key]
    late = prompt("a", 200, blocks=50, patient=False)
    assert take_prompts([late], [], LIMITS, 1000, 20, {}).parts == [(late.key, 200)]
    gone = prompt("a", 200, blocks=50, must_run=True)
    assert take_prompts([running, gone], [], LIMITS, 1000, 20, {}).parked == []
    # out of patience, but started prompts still run: it keeps waiting for them
    assert take_prompts([running, late], [], LIMITS, 1000, 60, {}).parked == [late.key]


def test_admission_counts_the_prompts_it_just_admitted():
    a, b = prompt("a", 10, blocks=40), prompt("b", 10, blocks=40)
    plan = take_prompts([a, b], [], LIMITS, room=1000, free_blocks=60, turns={})
    assert plan.parts == [(a.key, 10)] and plan.parked == [b.key]


# -- the decoder wait ----------------------------------------------------------------
def test_the_worker_waits_only_for_recent_decoders_not_yet_queued():
    batch = [decode("a", "x")]
    assert still_waiting_for({"x", "y"}, batch, [])
    assert not still_waiting_for({"x", "y"}, batch, [prompt("a", continues="y")])  # y is busy with a prompt
    assert not still_waiting_for({"x"}, batch, [])
