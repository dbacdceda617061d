"""``generate`` chooses on the server by default, and seeded server-side
sampling is reproducible: run after run, across a server restart (a fresh process on
the same port) and across a replica-set failover (the owner SIGKILLed half-way, the
sequence replayed on the other replica with its prompt/output split, so presence and
frequency penalties count the same output tokens)."""

from __future__ import annotations

import pytest

from ferrum_rpc.client import ExecutorClient, TokenChoice, connect
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.replicas import ReplicaPolicy, replay_pieces, shrink_spans
from ferrum_rpc.client.sampling import SamplingParams
from ferrum_rpc.client.speculative import speculative_generate
from ferrum_rpc.harness import all_serving
from tests.system.test_replicas import Replica

PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]
SAMPLED = SamplingParams(temperature=0.8, top_k=20, seed=7)
GREEDY = SamplingParams(greedy=True)
# strong penalties over the output: a replay that counted the output as prompt would change the draws
PENALISED = TokenChoice(temperature=0.8, top_k=20, seed=7, presence_penalty=1.5, frequency_penalty=1.0,
                        repetition_penalty=1.1)
FAST = ReplicaPolicy(status_ttl_s=0.5, down_cooldown_s=0.3, seed=0)


class Recording:
    """A client that records what generate asked for (token choices, logits policies)
    and what came back, passing every call through."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def prefill(self, *args, **kwargs):
        out = self.client.prefill(*args, **kwargs)
        self.calls.append(("prefill", kwargs.get("token_choice"), kwargs.get("logits"), out.logits))
        return out

    def decode(self, *args, **kwargs):
        out = self.client.decode(*args, **kwargs)
        self.calls.append(("decode", kwargs.get("token_choice"), kwargs.get("logits"), out.logits))
        return out


# -- the helpers against one in-process server -------------------------------------------------


@pytest.fixture(scope="module")
def one(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=60) as c:
        yield c


def test_generate_chooses_on_the_server_by_default_no_logits_on_the_wire(one):
    assert one.capabilities().token_choice
    rec = Recording(one)
    got = list(generate_ids(rec, PROMPT, 24, SAMPLED))
    assert len(got) == 24 and len(rec.calls) == 24
    for _, choice, logits_asked, logits_back in rec.calls:
        assert choice == SAMPLED.token_choice() and logits_asked is None and logits_back is None
    # the caller-side path on request: logits come back, no token choice goes out
    rec = Recording(one)
    list(generate_ids(rec, PROMPT, 4, SAMPLED, server_side=False))
    assert all(c is None and back is not None for _, c, _, back in rec.calls)
    assert one.status().active_sequences == 0  # both released their KV


def test_greedy_generate_is_the_old_greedy_token_for_token(one):
    old = list(generate_ids(one, PROMPT, 24, GREEDY, server_side=False))  # argmax of the logits, as before
    assert list(generate_ids(one, PROMPT, 24, GREEDY)) == old
    assert list(generate_ids(one, PROMPT, 24, GREEDY, server_side=True)) == old
    for token_choice in (True, False):
        for server_side in (True, False):
            result = speculative_generate(one, PROMPT, 24, k=3, server_side=server_side, token_choice=token_choice)
            assert result.tokens == old


def test_a_seed_gives_the_same_tokens_every_run(one):
    first = list(generate_ids(one, PROMPT, 24, SAMPLED))
    assert list(generate_ids(one, PROMPT, 24, SAMPLED)) == first
    assert first != list(generate_ids(one, PROMPT, 24, GREEDY))  # it sampled
    other = SamplingParams(temperature=0.8, top_k=20, seed=8)
    assert list(generate_ids(one, PROMPT, 24, other)) != first
    # a full TokenChoice (penalties) through generate: reproducible too
    penalised = list(generate_ids(one, PROMPT, 24, SAMPLED, token_choice=PENALISED))
    assert penalised == list(generate_ids(one, PROMPT, 24, SAMPLED, token_choice=PENALISED)) != first
    with pytest.raises(ValueError):
        list(generate_ids(one, PROMPT, 2, SAMPLED, server_side=False, token_choice=PENALISED))


def test_cli_takes_caller_side():
    from ferrum_rpc.cli import build_parser

    parse = build_parser().parse_args
    assert parse(["generate", "hi", "--caller-side"]).caller_side
    assert not parse(["generate", "hi", "--seed", "7"]).caller_side


# -- the replay rule ------------------------------------------------------------------------------


def test_replay_pieces_rebuild_the_servers_prompt_spans():
    assert replay_pieces(20, [(0, 8)]) == [(0, 8, True), (8, 20, False)]
    assert replay_pieces(8, [(0, 8)]) == [(0, 8, True)]
    assert replay_pieces(25, [(0, 8), (14, 17)]) == [(0, 8, True), (8, 14, False), (14, 17, True), (17, 25, False)]
    assert replay_pieces(11, [(0, 8), (8, 11)]) == [(0, 8, True), (8, 11, True)]
    assert replay_pieces(9, []) == [(0, 9, True)]  # unknown: all prompt, as before
    spans = [(0, 8), (14, 17)]
    shrink_spans(spans, 15)
    assert spans == [(0, 8), (14, 15)]
    shrink_spans(spans, 12)  # back past the continuation: forgotten (the server's rule)
    assert spans == [(0, 8)]
    shrink_spans(spans, 5)
    assert spans == [(0, 5)]


# -- real server processes ------------------------------------------------------------------------


def test_a_seed_gives_the_same_tokens_after_a_restart(tiny_llama_dir):
    with all_serving(Replica(tiny_llama_dir)) as (server,):
        with ExecutorClient(server.target, timeout=30) as ex:
            before = list(generate_ids(ex, PROMPT, 24, SAMPLED))
            penalised = list(generate_ids(ex, PROMPT, 24, SAMPLED, token_choice=PENALISED))
        first_instance = server.instance
        server.restart()
        assert server.instance != first_instance  # a fresh process on the same port
        with ExecutorClient(server.target, timeout=30) as ex:
            assert list(generate_ids(ex, PROMPT, 24, SAMPLED)) == before
            assert list(generate_ids(ex, PROMPT, 24, SAMPLED, token_choice=PENALISED)) == penalised
    assert len(before) == 24


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    with all_serving(Replica(tiny_llama_dir), Replica(tiny_llama_dir)) as replicas:
        yield replicas


def _run(ex, choice, steps, kill_at=None, continuation=(), continue_at=None, by_target=None):
    """Prefill PROMPT then decode with ``choice`` to ``steps`` chosen tokens; after
    ``continue_at`` tokens a continuation Prefill of ``continuation`` (prompt again);
    after ``kill_at`` tokens the owner is SIGKILLed.  Returns the chosen tokens, the
    replicas that owned the sequence and its tracked prompt spans at the end."""
    out = ex.prefill(PROMPT, token_choice=choice)
    got, handle, owners = [out.chosen.token_id], out.kv_cache, [ex.replica_of(out.kv_cache)]
    while len(got) < steps:
        if len(got) == kill_at:
            by_target[ex.replica_of(handle)].kill()
        if len(got) == continue_at:
            out = ex.prefill(list(continuation), handle, token_choice=choice)
        else:
            out = ex.decode(got[-1], handle, token_choice=choice)
        got.append(out.chosen.token_id)
        handle = out.kv_cache
        owners.append(ex.replica_of(handle))
    (seq,) = ex.live_sequences()
    ex.release_cache(handle)
    return got, owners, seq.prompt_spans


def _restart_dead(pair):
    for r in pair:
        if not r.alive():
            r.restart()


@pytest.mark.parametrize("choice", [TokenChoice(temperature=0.8, top_k=20, seed=7), PENALISED],
                         ids=["seeded", "seeded+penalties"])
def test_sigkill_half_way_gives_the_uninterrupted_tokens(pair, choice):
    by_target = {r.target: r for r in pair}
    try:
        with connect([r.target for r in pair], timeout=30, replica_policy=FAST) as ex:
            want, owners, spans = _run(ex, choice, 24)
            assert len(set(owners)) == 1 and spans == ((0, len(PROMPT)),)
            got, owners, spans = _run(ex, choice, 24, kill_at=12, by_target=by_target)
            assert owners[0] != owners[-1]  # it moved
            assert got == want
            assert spans == ((0, len(PROMPT)),)  # replayed: the prompt as a Prefill, the output as output
            assert ex.live_sequences() == []
    finally:
        _restart_dead(pair)


def test_sigkill_after_a_continuation_prefill_keeps_both_prompt_spans(pair):
    by_target = {r.target: r for r in pair}
    continuation = [4, 5, 6]
    try:
        with connect([r.target for r in pair], timeout=30, replica_policy=FAST) as ex:
            want, _, spans = _run(ex, PENALISED, 24, continuation=continuation, continue_at=6)
            # 6 chosen tokens: PROMPT + 5 in the KV, then the continuation
            assert spans == ((0, len(PROMPT)), (len(PROMPT) + 5, len(PROMPT) + 8))
            got, owners, got_spans = _run(ex, PENALISED, 24, kill_at=14, continuation=continuation,
                                          continue_at=6, by_target=by_target)
            assert owners[0] != owners[-1] and got == want and got_spans == spans
    finally:
        _restart_dead(pair)


def test_replaying_the_output_as_prompt_would_change_the_penalised_draws(pair):
    """Why the replay keeps the split: the same history prefilled as one prompt (what a
    replay did before) draws other tokens under presence/frequency penalties."""
    with ExecutorClient(pair[0].target, timeout=30) as ex:
        want, _, _ = _run_single(ex, PENALISED, 24)
        out = ex.prefill(PROMPT + want[:11], token_choice=PENALISED)  # 11 outputs in the KV, all as prompt
        lost = want[:11] + [out.chosen.token_id]
        handle = out.kv_cache
        while len(lost) < 24:
            out = ex.decode(lost[-1], handle, token_choice=PENALISED)
            lost.append(out.chosen.token_id)
            handle = out.kv_cache
        ex.release_cache(handle)
    assert lost != want


def _run_single(ex, choice, steps):
    out = ex.prefill(PROMPT, token_choice=choice)
    got, handle = [out.chosen.token_id], out.kv_cache
    while len(got) < steps:
        out = ex.decode(got[-1], handle, token_choice=choice)
        got.append(out.chosen.token_id)
        handle = out.kv_cache
    ex.release_cache(handle)
    return got, None, None


@pytest.mark.parametrize("choice", [TokenChoice(temperature=0.8, top_k=20, seed=7), PENALISED],
                         ids=["seeded", "seeded+penalties"])
def test_decoding_ahead_on_a_replica_set_survives_a_sigkill_with_the_same_tokens(pair, choice):
    """A decode-ahead run whose owner is SIGKILLed after 10 tokens goes on on the other
    replica (its history replayed, the 10 tokens appended) and gives the tokens of an
    uninterrupted run; the sequence's history and prompt spans come out right (a decode
    after the run continues the tokens of step-by-step decoding)."""
    by_target = {r.target: r for r in pair}
    try:
        with connect([r.target for r in pair], timeout=30, replica_policy=FAST) as ex:
            want, _, _ = _run(ex, choice, 41)
            out = ex.prefill(PROMPT, token_choice=choice)
            owner = ex.replica_of(out.kv_cache)
            seen = []

            def on_token(chosen):
                seen.append(chosen.token_id)
                if len(seen) == 10:
                    by_target[owner].kill()

            result = ex.decode_ahead(out.chosen.token_id, out.kv_cache, choice, 39, on_token=on_token)
            assert ex.replica_of(result.kv_cache) != owner  # it moved
            assert [out.chosen.token_id] + [c.token_id for c in result.chosen] == want[:40] == \
                [out.chosen.token_id] + seen
            assert result.finish_reason == "length" and result.kv_cache.sequence_length == len(PROMPT) + 39
            step = ex.decode(result.chosen[-1].token_id, result.kv_cache, token_choice=choice)
            assert step.chosen.token_id == want[40]
            (seq,) = ex.live_sequences()
            assert seq.prompt_spans == ((0, len(PROMPT)),) and len(seq.tokens) == len(PROMPT) + 40
            ex.release_cache(step.kv_cache)
    finally:
        _restart_dead(pair)


def test_decoding_ahead_on_an_asyncio_replica_set_stops_on_request(pair):
    import asyncio

    from ferrum_rpc.client import connect_async

    choice = TokenChoice(temperature=0.8, top_k=20, seed=7)
    with connect([r.target for r in pair], timeout=30, replica_policy=FAST) as ex:
        want, _, _ = _run(ex, choice, 30)

    async def main():
        async with connect_async([r.target for r in pair], timeout=30, replica_policy=FAST) as ax:
            out = await ax.prefill(PROMPT, token_choice=choice)

            async def on_token(chosen):
                return chosen.token_id == want[5]  # stop once this token arrives

            result = await ax.decode_ahead(out.chosen.token_id, out.kv_cache, choice, 25, on_token=on_token)
            await ax.release_cache(result.kv_cache)
            return out, result

    out, result = asyncio.run(main())
    got = [out.chosen.token_id] + [c.token_id for c in result.chosen]
    assert result.finish_reason in ("stopped", "length") and got == want[:len(got)]
    assert 6 <= len(got) < 26 and result.kv_cache.sequence_length == len(PROMPT) + len(got) - 1
