"""The one append path (``TorchExecutor.run``): prompts' parts (prefills,
verifies) and decodes share one forward, each equal to transformers on its own
sequence; and a forward or LM head that fails leaves every sequence exactly
as it was before its call (blocks, lengths, tokens, idle clocks)."""

from __future__ import annotations

import numpy as np
import pytest

from ferrum_rpc.errors import KvCapacityExhausted
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor, verify_policy
from ferrum_rpc.types import DecodeInput, LogitsPolicy
from tests.conftest import executor_snapshot as snapshot
from tests.conftest import oracle_rows

FULL = LogitsPolicy.full()
ATOL = 1e-4


@pytest.fixture
def ex(tiny_llama_dir):
    return TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=512, block_size=4,
                                                                         prefill_chunk=5))


def test_prefill_verify_and_decodes_in_one_forward_each_equal_transformers(ex, hf_tiny_llama):
    a, b, c = [5, 17, 101, 3, 250, 42, 7], [9, 300, 11], [64, 2, 77, 8, 8, 13, 21, 34, 55]
    ha = ex.prefill(a, None, LogitsPolicy.argmax()).kv_cache
    hb = ex.prefill(b, None, LogitsPolicy.argmax()).kv_cache
    verify = [4, 44, 144]
    new, cont = ex.open_prefill(c, None, FULL), ex.open_prefill(verify, hb, verify_policy(FULL))
    plans = [
        new.next_part(len(c)),  # a new prompt, whole: last position
        cont.next_part(len(verify)),  # ForwardVerify: every position
        ex.plan_decode([DecodeInput(99, ha)], FULL),  # a decode
    ]
    forwards = ex.stats.forwards
    new_rows, cont_rows, (decoded,) = ex.run(plans)
    prefill, verified = new.part_done(plans[0], new_rows), cont.part_done(plans[1], cont_rows)
    assert ex.stats.forwards == forwards + 1  # one forward for all three kinds
    np.testing.assert_allclose(prefill.logits.values[0], oracle_rows(hf_tiny_llama, c)[-1], atol=ATOL, rtol=0)
    np.testing.assert_allclose(verified.logits.values, oracle_rows(hf_tiny_llama, b + verify)[-3:], atol=ATOL,
                               rtol=0)
    np.testing.assert_allclose(decoded.logits.values[0], oracle_rows(hf_tiny_llama, a + [99])[-1], atol=ATOL,
                               rtol=0)
    assert (prefill.kv_cache.sequence_length, verified.kv_cache.sequence_length,
            decoded.kv_cache.sequence_length) == (len(c), len(b) + 3, len(a) + 1)


def test_chunked_verify_returns_every_row_of_every_chunk(ex, hf_tiny_llama):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    handle = ex.prefill(prompt, None, LogitsPolicy.argmax()).kv_cache
    tail = list(range(20, 33))  # 13 tokens: chunks of 5, 5, 3
    out = ex.forward_verify(tail, handle, FULL)
    np.testing.assert_allclose(out.logits.values, oracle_rows(hf_tiny_llama, prompt + tail)[-13:], atol=ATOL,
                               rtol=0)


class Boom(RuntimeError):
    pass


def fail_lm_head(ex: TorchExecutor, monkeypatch, after: int = 0) -> None:
    """Fault injection: the LM head raises on its (after+1)-th call from now."""
    real, calls = ex.model.logits, [0]

    def logits(hidden):
        calls[0] += 1
        if calls[0] > after:
            raise Boom("injected")
        return real(hidden)

    monkeypatch.setattr(ex.model, "logits", logits)


def fail_forward(ex: TorchExecutor, monkeypatch) -> None:
    def forward(*args, **kwargs):
        raise Boom("injected")

    monkeypatch.setattr(ex.model, "forward", forward)


@pytest.mark.parametrize("where", ["forward", "lm_head"])
def test_a_failed_mixed_forward_leaves_every_sequence_as_it_was(ex, monkeypatch, where):
    ha = ex.prefill([1, 2, 3, 4, 5, 6], None, LogitsPolicy.argmax()).kv_cache  # 1.5 blocks
    child, = ex.fork_cache(ha, 1)  # shares ha's blocks: a write copies the shared one
    hb = ex.prefill([7, 8], None, LogitsPolicy.argmax()).kv_cache
    before = snapshot(ex)
    new, cont = ex.open_prefill([9, 10, 11, 12, 13], None, FULL), ex.open_prefill([14, 15, 16], hb, verify_policy(FULL))
    plans = [new.next_part(5), cont.next_part(3),
             ex.plan_decode([DecodeInput(17, ha), DecodeInput(18, child)], FULL)]
    (fail_forward if where == "forward" else fail_lm_head)(ex, monkeypatch)
    with pytest.raises(Boom):
        ex.run(plans)
    new.abandon()  # what the worker does for prompts whose forward failed
    cont.abandon()
    assert snapshot(ex) == before
    monkeypatch.undo()
    out = ex.decode(17, ha)  # and the sequences still serve
    assert out.kv_cache.sequence_length == 7


def test_a_chunked_prefill_failing_in_a_later_chunk_is_undone_entirely(ex, monkeypatch):
    handle = ex.prefill([1, 2, 3], None, LogitsPolicy.argmax()).kv_cache
    before = snapshot(ex)
    fail_lm_head(ex, monkeypatch, after=1)  # chunks of 5: the 1st chunk's rows pass, the 2nd fails
    with pytest.raises(Boom):
        ex.forward_verify(list(range(20, 32)), handle, FULL)
    assert snapshot(ex) == before
    monkeypatch.undo()
    fail_forward(ex, monkeypatch)
    with pytest.raises(Boom):  # a new prompt: the sequence it made is forgotten
        ex.prefill(list(range(40, 52)), None, FULL)
    assert snapshot(ex) == before


def test_a_plan_that_cannot_reserve_room_gives_back_what_it_took(tiny_llama_dir):
    ex = TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=16, block_size=4))
    ha = ex.prefill([1, 2, 3, 4], None, LogitsPolicy.argmax()).kv_cache  # 1 of 4 blocks, full
    hb = ex.prefill([5, 6, 7, 8, 9, 10, 11, 12], None, LogitsPolicy.argmax()).kv_cache  # 2 blocks, full
    before = snapshot(ex)
    assert before["free"] == 1
    with pytest.raises(KvCapacityExhausted):  # ha takes the last free block, hb finds none
        ex.plan_decode([DecodeInput(1, ha), DecodeInput(2, hb)], FULL)
    assert snapshot(ex) == before


def test_a_row_whose_logits_are_not_finite_fails_its_call_alone(ex):
    """A sequence whose KV holds NaN (corrupt state) asks for a token choice in the same
    forward as others: its call alone gets NON_FINITE_LOGITS and is put back; the other
    calls (a decode, a prompt's last part) are served as if it were absent."""
    from ferrum_rpc.errors import NonFiniteLogits
    from ferrum_rpc.types import TokenChoice

    sampled = TokenChoice(temperature=1.0, top_k=40, seed=5)
    bad = ex.prefill([5, 17, 101, 3], None, LogitsPolicy.argmax()).kv_cache
    good = ex.prefill([9, 300, 11], None, LogitsPolicy.argmax()).kv_cache
    alone = ex.decode(7, good, None, choice=sampled).chosen
    ex.truncate_kv(ex.handle(ex.kv.get(good.cache_id)), good.sequence_length)
    ex.pool.k[:, ex.kv.get(bad.cache_id).block_ids] = float("nan")
    before = snapshot(ex)
    for choice in (sampled, TokenChoice.greedy(), TokenChoice(temperature=0.5, top_p=0.9, seed=1)):
        prompt = ex.open_prefill([4, 44, 144], None, None, choice=sampled)
        plans = [ex.plan_decode([DecodeInput(8, bad, choice)], None),
                 ex.plan_decode([DecodeInput(7, good, sampled)], None), prompt.next_part(3)]
        failed, (served,), part = ex.run(plans)
        assert isinstance(failed, NonFiniteLogits) and "not finite" in str(failed)
        assert served.chosen == alone and served.kv_cache.sequence_length == good.sequence_length + 1
        assert prompt.part_done(plans[2], part).chosen is not None
        ex.truncate_kv(served.kv_cache, good.sequence_length)
        assert snapshot(ex)["seqs"][bad.cache_id] == before["seqs"][bad.cache_id]
    with pytest.raises(NonFiniteLogits):
        ex.decode(8, bad, None, choice=sampled)
    assert snapshot(ex)["seqs"][bad.cache_id] == before["seqs"][bad.cache_id]
