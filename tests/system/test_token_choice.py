"""The server chooses tokens through real gRPC: Prefill, Decode, BatchDecode,
DecodeSession and BatchPrefill with a ``token_choice``; transformers' ``generate`` as
the oracle for greedy decoding with a repetition penalty and a logit bias; seeded
sampling independent of the batch; RAW logprobs against the FULL logits; bad
policies refused with no state change."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
import torch

from ferrum_rpc import convert
from ferrum_rpc.client import (
    DecodeInput,
    ExecutorClient,
    InvalidInput,
    LogitsPolicy,
    LogprobsMode,
    TokenChoice,
)
from ferrum_rpc.rules import pack_allowed_tokens
from ferrum_rpc.server.kv.blocks import BlockManager
from ferrum_rpc.server.choice.sampling import choose_tokens
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc

PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]
STEPS = 24
SAMPLED = TokenChoice(temperature=0.8, top_k=20, top_p=0.9, seed=1234)


@pytest.fixture(scope="module")
def client(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def stub(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


def _generate_alone(client, prompt, choice, steps):
    """Prefill with the choice, then Decode the chosen token each step: ``steps`` tokens."""
    out = client.prefill(prompt, token_choice=choice)
    assert out.logits is None and out.chosen is not None  # logits unset: the chosen token only
    chosen = [out.chosen]
    handle = out.kv_cache
    while len(chosen) < steps:
        out = client.decode(chosen[-1].token_id, handle, token_choice=choice)
        assert out.logits is None
        chosen.append(out.chosen)
        handle = out.kv_cache
    client.release_cache(handle)
    return chosen


def _hf_generate(hf, prompt, steps, **kwargs):
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None, **kwargs)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def test_capabilities_say_token_choice_is_served(client):
    assert client.capabilities().token_choice


def test_greedy_with_repetition_penalty_equals_transformers(client, hf_tiny_llama):
    choice = TokenChoice.greedy(repetition_penalty=1.3)
    ours = [c.token_id for c in _generate_alone(client, PROMPT, choice, STEPS)]
    expected = _hf_generate(hf_tiny_llama, PROMPT, STEPS, repetition_penalty=1.3)
    assert len(expected) == STEPS
    assert ours == expected
    plain = [c.token_id for c in _generate_alone(client, PROMPT, TokenChoice.greedy(), STEPS)]
    assert plain == _hf_generate(hf_tiny_llama, PROMPT, STEPS)
    assert plain != ours  # the penalty mattered


def test_greedy_with_logit_bias_and_repetition_penalty_equals_transformers(client, hf_tiny_llama):
    bias = {7: 4.0, 150: 2.5, 33: -100.0, 64: 1.5}
    choice = TokenChoice.greedy(repetition_penalty=1.2, logit_bias=bias)
    ours = [c.token_id for c in _generate_alone(client, PROMPT, choice, STEPS)]
    expected = _hf_generate(hf_tiny_llama, PROMPT, STEPS, repetition_penalty=1.2,
                            sequence_bias={(t,): b for t, b in bias.items()})
    assert ours == expected
    assert 33 not in ours


def _mixed_prompts():
    """Seven other sequences: prompts of other lengths and other policies (or none)."""
    rng = np.random.default_rng(5)
    choices = [TokenChoice.greedy(), TokenChoice(temperature=1.0, seed=9), None,
               TokenChoice(temperature=0.7, top_p=0.8, seed=1234, presence_penalty=0.5),
               TokenChoice(temperature=1.3, min_p=0.05), None, TokenChoice.greedy(repetition_penalty=1.5)]
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (3, 11, 6, 2, 17, 9, 5)]
    return prompts, choices


def _same_draws(got, expected):
    """The same tokens; logprobs equal up to the float rounding of a batched forward
    (a row's logits in a batch differ from its logits alone in the last bits)."""
    assert [c.token_id for c in got] == [c.token_id for c in expected]
    assert np.allclose([c.logprob for c in got], [c.logprob for c in expected], atol=1e-5, rtol=0)


def test_seeded_sampling_is_the_same_alone_in_a_batch_and_in_a_session(client):
    alone = _generate_alone(client, PROMPT, SAMPLED, 12)
    again = _generate_alone(client, PROMPT, SAMPLED, 12)
    assert [(c.token_id, c.logprob) for c in alone] == [(c.token_id, c.logprob) for c in again]
    other_seed = _generate_alone(client, PROMPT, TokenChoice(temperature=0.8, top_k=20, top_p=0.9, seed=99), 12)
    assert [c.token_id for c in other_seed] != [c.token_id for c in alone]

    prompts, choices = _mixed_prompts()
    # BatchPrefill of all 8 (ours third), then BatchDecode steps of the 8 mixed sequences
    outs = client.batch_prefill(prompts[:2] + [PROMPT] + prompts[2:],
                                token_choice=choices[:2] + [SAMPLED] + choices[2:])
    _same_draws([outs[2].chosen], alone[:1])
    policies = choices[:2] + [SAMPLED] + choices[2:]
    handles = [o.kv_cache for o in outs]
    nexts = [o.chosen.token_id if o.chosen else int(np.argmax(o.logits.values[0])) for o in outs]
    got = [outs[2].chosen]
    for _ in range(11):
        items = [DecodeInput(t, h, c) for t, h, c in zip(nexts, handles, policies)]
        step = client.batch_decode(items)
        for o, c in zip(step, policies):
            assert (o.logits is None) == (c is not None)  # logits unset: rows only for items without a choice
        got.append(step[2].chosen)
        handles = [o.kv_cache for o in step]
        nexts = [o.chosen.token_id if o.chosen else int(np.argmax(o.logits.values[0])) for o in step]
    _same_draws(got, alone)
    for h in handles:
        client.release_cache(h)

    # a DecodeSession, ours second of three, the others greedy and plain logits
    first = client.batch_prefill([prompts[0], PROMPT, prompts[4]], token_choice=[choices[0], SAMPLED, None])
    handles = [o.kv_cache for o in first]
    nexts = [first[0].chosen.token_id, first[1].chosen.token_id, int(np.argmax(first[2].logits.values[0]))]
    got = [first[1].chosen]
    with client.decode_session() as session:
        for _ in range(11):
            step = session.step([DecodeInput(nexts[0], handles[0], choices[0]),
                                 DecodeInput(nexts[1], handles[1], SAMPLED), (nexts[2], handles[2])])
            got.append(step[1].chosen)
            handles = [o.kv_cache for o in step]
            nexts = [step[0].chosen.token_id, step[1].chosen.token_id, int(np.argmax(step[2].logits.values[0]))]
    _same_draws(got, alone)
    for h in handles:
        client.release_cache(h)


def test_raw_logprobs_are_the_full_logits_log_softmax(client):
    choice = TokenChoice(temperature=0.7, top_k=10, seed=3, repetition_penalty=1.4, top_logprobs=5,
                         logit_bias={11: 3.0})
    out = client.prefill(PROMPT, logits=LogitsPolicy.full(), token_choice=choice)
    handle, rows = out.kv_cache, [(out.logits, out.chosen)]
    for _ in range(3):
        out = client.decode(out.chosen.token_id, handle, logits=LogitsPolicy.full(), token_choice=choice)
        handle = out.kv_cache
        rows.append((out.logits, out.chosen))
    for logits, chosen in rows:
        assert logits is not None and chosen is not None  # logits set: both
        log_softmax = torch.log_softmax(torch.tensor(logits.values[0], dtype=torch.float64), -1).numpy()
        assert abs(chosen.logprob - log_softmax[chosen.token_id]) < 1e-5
        top = np.argsort(-log_softmax)[:5]
        assert [t.token_id for t in chosen.top_logprobs] == top.tolist()
        assert np.allclose([t.logprob for t in chosen.top_logprobs], log_softmax[top], atol=1e-5)
    client.release_cache(handle)

    # PROCESSED: the distribution the draw used (greedy: the penalised, biased row)
    processed = TokenChoice.greedy(logit_bias={11: 3.0}, top_logprobs=3, logprobs_mode=LogprobsMode.PROCESSED)
    out = client.prefill(PROMPT, logits=LogitsPolicy.full(), token_choice=processed)
    row = torch.tensor(out.logits.values[0], dtype=torch.float64)
    row[11] += 3.0
    assert out.chosen.token_id == int(row.argmax())
    assert abs(out.chosen.logprob - float(torch.log_softmax(row, -1)[out.chosen.token_id])) < 1e-5
    client.release_cache(out.kv_cache)


def test_greedy_under_a_bitmask_is_the_masked_rows_argmax_on_every_path(client):
    """A greedy choice whose only shaping is an allowed-token bitmask (the server's fast
    path: the model's argmax where the mask allows it, else the masked row's): each
    step's token is the first largest allowed logit of the FULL row and its RAW logprob
    the row's log-softmax; Decode steps, decoding ahead (a burst) and a DecodeSession
    beside an unmasked greedy row give the same tokens and logprob bits."""
    plain = [c.token_id for c in _generate_alone(client, PROMPT, TokenChoice.greedy(), 12)]
    banned = set(plain[1:]) | set(range(8))  # the unmasked argmax is forbidden at most steps
    choice = TokenChoice.greedy(allowed_token_bitmask=pack_allowed_tokens(set(range(320)) - banned, 320))
    out = client.prefill(PROMPT, token_choice=choice)
    first, handle = out.chosen, out.kv_cache
    stepped, token = [], first.token_id
    for _ in range(12):
        out = client.decode(token, handle, logits=LogitsPolicy.full(), token_choice=choice)
        row = torch.tensor(out.logits.values[0], dtype=torch.float64)
        masked = row.clone()
        masked[sorted(banned)] = -math.inf
        assert out.chosen.token_id == int(masked.max(-1).indices) and out.chosen.token_id not in banned
        assert abs(out.chosen.logprob - float(torch.log_softmax(row, -1)[out.chosen.token_id])) < 1e-5
        stepped.append(out.chosen)
        token, handle = out.chosen.token_id, out.kv_cache
    client.release_cache(handle)
    assert [c.token_id for c in stepped] != plain[1:13]  # the mask changed the text

    out = client.prefill(PROMPT, token_choice=choice)
    ahead = client.decode_ahead(out.chosen.token_id, out.kv_cache, choice, 12)
    assert [(c.token_id, c.logprob) for c in ahead.chosen] == [(c.token_id, c.logprob) for c in stepped]
    client.release_cache(ahead.kv_cache)

    outs = client.batch_prefill([PROMPT, PROMPT], token_choice=[TokenChoice.greedy(), choice])
    handles, nexts, got = [o.kv_cache for o in outs], [o.chosen.token_id for o in outs], []
    with client.decode_session() as session:
        for _ in range(12):
            step = session.step([DecodeInput(nexts[0], handles[0], TokenChoice.greedy()),
                                 DecodeInput(nexts[1], handles[1], choice)])
            got.append(step[1].chosen)
            handles, nexts = [o.kv_cache for o in step], [o.chosen.token_id for o in step]
    assert [(c.token_id, c.logprob) for c in got] == [(c.token_id, c.logprob) for c in stepped]
    for h in handles:
        client.release_cache(h)


def test_penalties_split_prompt_from_output(client):
    """Presence/frequency count the tokens appended by decode steps only (the output);
    a Prefill makes every token so far prompt; the repetition penalty covers both."""
    choice = TokenChoice.greedy(presence_penalty=2.0, frequency_penalty=1.5, repetition_penalty=1.3)
    out = client.prefill(PROMPT, logits=LogitsPolicy.full(), token_choice=choice)
    tokens, handle = list(PROMPT), out.kv_cache
    output: list[int] = []
    prompt_len = len(PROMPT)

    def check(out):
        expected = choose_tokens(torch.from_numpy(out.logits.values.copy()), [choice], [len(tokens)],
                                 [tokens[:prompt_len]], [tokens[prompt_len:]]).row(0)
        assert out.chosen.token_id == expected.token_id

    check(out)
    for _ in range(5):
        tokens.append(out.chosen.token_id)
        out = client.decode(out.chosen.token_id, handle, logits=LogitsPolicy.full(), token_choice=choice)
        handle = out.kv_cache
        check(out)
    # a continuation Prefill: all of it is prompt now
    tokens.extend([4, 5, 6])
    out = client.prefill([4, 5, 6], handle, logits=LogitsPolicy.full(), token_choice=choice)
    prompt_len, handle = len(tokens), out.kv_cache
    check(out)
    tokens.append(out.chosen.token_id)
    out = client.decode(out.chosen.token_id, handle, logits=LogitsPolicy.full(), token_choice=choice)
    handle = out.kv_cache
    check(out)
    # truncated back into the decoded tokens: the continuation is forgotten
    handle = client.truncate_kv(handle, len(PROMPT) + 3)
    del tokens[len(PROMPT) + 3:]
    prompt_len = len(PROMPT)
    out = client.decode(7, handle, logits=LogitsPolicy.full(), token_choice=choice)
    tokens.append(7)
    check(out)
    # a fork keeps the split
    (child,) = client.fork_cache(out.kv_cache, 1)
    out = client.decode(9, child, logits=LogitsPolicy.full(), token_choice=choice)
    tokens.append(9)
    check(out)
    client.release_cache(child)
    client.release_cache(handle.cache_id)


def test_prompt_spans_follow_shrink_and_fork():
    kv = BlockManager(16, 4)
    seq = kv.create("a")
    plan = kv.prepare_write(seq, 0, 6)
    kv.commit(seq, 0, [1, 2, 3, 4, 5, 6])
    kv.mark_prompt(seq, 0, 6)
    kv.prepare_write(seq, 6, 9)
    kv.commit(seq, 6, [7, 8, 9])  # decode steps
    assert seq.output_start == 6
    kv.prepare_write(seq, 9, 12)
    kv.commit(seq, 9, [10, 11, 12])
    kv.mark_prompt(seq, 9, 12)  # a continuation prefill
    assert seq.output_start == 12
    (child,) = kv.fork(seq, ["b"])
    assert child.output_start == 12 and child.prompt_spans is not seq.prompt_spans
    kv.shrink(seq, 9)  # undoing the continuation
    assert seq.output_start == 6 and child.output_start == 12
    kv.shrink(child, 10)  # through the continuation
    assert child.output_start == 10
    kv.shrink(seq, 4)
    assert seq.output_start == 4
    del plan


def _status(stub):
    s = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    return s.active_sequences, s.kv_blocks_used


def _invalid(call, *words):
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if hasattr(result, "__iter__") and not isinstance(result, (pb.PrefillResponse, pb.DecodeResponse)):
            list(result)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value
    for word in words:
        assert word in info.value.details(), info.value.details()


def test_bad_token_choice_is_invalid_input_and_changes_nothing(stub, client):
    handle = stub.Prefill(pb.PrefillRequest(token_ids=[3, 7, 11], logits=pb.LogitsPolicy(
        kind=pb.LOGITS_KIND_ARGMAX)), timeout=30).kv_cache
    other = stub.Prefill(pb.PrefillRequest(token_ids=[4, 8], logits=pb.LogitsPolicy(
        kind=pb.LOGITS_KIND_ARGMAX)), timeout=30).kv_cache
    before = _status(stub)
    nan = pb.TokenChoice(temperature=math.nan)
    mask = pb.TokenChoice(allowed_token_bitmask=b"\xff" * 12)  # 320 tokens need 10 words = 40 bytes
    good = pb.TokenChoice(temperature=0.0)

    _invalid(lambda: stub.Prefill(pb.PrefillRequest(token_ids=[3, 7], token_choice=nan), timeout=30),
             "token_choice.temperature")
    _invalid(lambda: stub.Prefill(pb.PrefillRequest(token_ids=[3, 7], token_choice=mask), timeout=30),
             "token_choice.allowed_token_bitmask")
    _invalid(lambda: stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, token_choice=mask), timeout=30),
             "allowed_token_bitmask")
    _invalid(lambda: stub.BatchDecode(pb.BatchDecodeRequest(items=[
        pb.DecodeItem(kv_cache=handle, token_id=2, token_choice=good),
        pb.DecodeItem(kv_cache=other, token_id=2, token_choice=nan)]), timeout=30), "items[1].token_choice.temperature")
    _invalid(lambda: stub.BatchPrefill(pb.BatchPrefillRequest(items=[
        pb.PrefillItem(token_ids=[5, 6], token_choice=good),
        pb.PrefillItem(token_ids=[5, 6, 7], token_choice=mask)]), timeout=30), "items[1].token_choice")
    session = stub.DecodeSession(iter([pb.DecodeSessionRequest(
        step_id=1, items=[pb.DecodeItem(kv_cache=handle, token_id=2, token_choice=nan)])]), timeout=30)
    (reply,) = list(session)
    assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in reply.error.message

    assert _status(stub) == before
    with pytest.raises(InvalidInput):  # the typed client maps it too
        client.decode(2, convert.handle_from_proto(handle), token_choice=TokenChoice(top_p=0.0))
    out = stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, token_choice=good), timeout=30)
    assert out.kv_cache.sequence_length == handle.sequence_length + 1  # the handle was still current
    assert not out.HasField("logits") and out.HasField("chosen")
    for h in (out.kv_cache, other):
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=h.cache_id), timeout=30)


def test_speculative_decode_by_the_servers_choice_gives_the_decode_steps_tokens(client):
    choice = TokenChoice(temperature=0.9, top_k=30, seed=77, repetition_penalty=1.2, presence_penalty=0.7,
                         top_logprobs=2)
    reference = _generate_alone(client, PROMPT, choice, 16)
    tokens = [c.token_id for c in reference]
    out = client.prefill(PROMPT, token_choice=choice)
    got, handle = [out.chosen], out.kv_cache
    rounds = 0
    while len(got) < 16:
        at = len(got)
        draft = tokens[at:at + 3]
        if rounds % 2 and len(draft) > 1:
            draft[1] = (draft[1] + 1) % 320  # a wrong draft: rejected, the rest dropped
        spec = client.speculative_decode(got[-1].token_id, draft, handle, token_choice=choice)
        assert spec.logits is None and len(spec.chosen) == len(spec.accepted_token_ids) + 1
        assert list(spec.accepted_token_ids) == [c.token_id for c in spec.chosen[:-1]]
        assert spec.next_token_id == spec.chosen[-1].token_id
        got.extend(spec.chosen)
        handle = spec.kv_cache
        assert handle.sequence_length == len(PROMPT) + len(got) - 1
        rounds += 1
    _same_draws(got[:16], reference)
    assert rounds < 15  # drafts were kept
    client.release_cache(handle)


def test_speculative_decode_takes_a_token_choice_or_sampling_not_both(stub):
    handle = stub.Prefill(pb.PrefillRequest(token_ids=[3, 7, 11], logits=pb.LogitsPolicy(
        kind=pb.LOGITS_KIND_ARGMAX)), timeout=30).kv_cache
    before = _status(stub)
    _invalid(lambda: stub.SpeculativeDecode(pb.SpeculativeDecodeRequest(
        kv_cache=handle, token_id=2, draft_token_ids=[4], token_choice=pb.TokenChoice(seed=1),
        sampling=pb.SpeculativeSampling(temperature=1.0, seed=1)), timeout=30), "exclusive")
    _invalid(lambda: stub.SpeculativeDecode(pb.SpeculativeDecodeRequest(
        kv_cache=handle, token_id=2, draft_token_ids=[4], token_choice=pb.TokenChoice(top_p=1.5)), timeout=30),
        "token_choice.top_p")
    assert _status(stub) == before
    out = stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2), timeout=30)
    assert out.kv_cache.sequence_length == handle.sequence_length + 1 and out.HasField("logits")
    stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=handle.cache_id), timeout=30)


def test_the_asyncio_client_chooses_alike(tiny_server, client):
    import asyncio

    from ferrum_rpc.client import AsyncExecutorClient

    expected = _generate_alone(client, PROMPT, SAMPLED, 4)

    async def run():
        async with AsyncExecutorClient(tiny_server.target, timeout=60) as ex:
            out = await ex.prefill(PROMPT, token_choice=SAMPLED)
            got, handle = [out.chosen], out.kv_cache
            async with ex.decode_session() as session:
                for _ in range(3):
                    (step,) = await session.step([(got[-1].token_id, handle)], token_choice=SAMPLED)
                    got.append(step.chosen)
                    handle = step.kv_cache
            await ex.release_cache(handle)
            return got

    _same_draws(asyncio.run(run()), expected)


def test_a_replica_set_passes_each_items_token_choice(tiny_server, tiny_llama_dir, client):
    from tests.conftest import running_server

    from ferrum_rpc.client import ReplicaSetClient

    prompts, choices = _mixed_prompts()
    prompts, choices = prompts[:4], [SAMPLED, choices[0], None, choices[3]]
    expected = [_generate_alone(client, p, c, 3) if c is not None else None for p, c in zip(prompts, choices)]
    with running_server(tiny_llama_dir) as second, \
            ReplicaSetClient([tiny_server.target, second.target], timeout=60) as ex:
        outs = ex.batch_prefill(prompts, token_choice=choices)
        got = [[o.chosen] for o in outs]
        handles = [o.kv_cache for o in outs]
        nexts = [o.chosen.token_id if o.chosen else int(np.argmax(o.logits.values[0])) for o in outs]
        with ex.decode_session() as session:
            for step in range(2):
                items = [DecodeInput(t, h, c) for t, h, c in zip(nexts, handles, choices)]
                step_outs = ex.batch_decode(items) if step == 0 else session.step(items)
                for g, o in zip(got, step_outs):
                    g.append(o.chosen)
                handles = [o.kv_cache for o in step_outs]
                nexts = [o.chosen.token_id if o.chosen else int(np.argmax(o.logits.values[0])) for o in step_outs]
        for g, e in zip(got, expected):
            if e is None:
                assert g == [None] * 3
            else:
                _same_draws(g, e)
        for h in handles:
            ex.release_cache(h)


def test_an_undone_continuation_prefill_puts_the_split_back(client):
    """BatchPrefill is all or nothing: a continuation that ran is undone when another
    prompt fails, and the sequence's output starts where it did before."""
    choice = TokenChoice.greedy(presence_penalty=2.0, frequency_penalty=2.0)
    out = client.prefill(PROMPT, logits=LogitsPolicy.full(), token_choice=choice)
    tokens, handle = list(PROMPT), out.kv_cache
    for _ in range(3):
        tokens.append(out.chosen.token_id)
        out = client.decode(out.chosen.token_id, handle, logits=LogitsPolicy.full(), token_choice=choice)
        handle = out.kv_cache
    with pytest.raises(InvalidInput):
        client.batch_prefill([([4, 5], handle), [999]], token_choice=choice)  # 999 is past the vocabulary
    tokens.append(out.chosen.token_id)
    out = client.decode(out.chosen.token_id, handle, logits=LogitsPolicy.full(), token_choice=choice)
    expected = choose_tokens(torch.tensor(out.logits.values), [choice], [len(tokens)],
                             [tokens[:len(PROMPT)]], [tokens[len(PROMPT):]]).row(0)
    assert out.chosen.token_id == expected.token_id
    client.release_cache(out.kv_cache)
