"""One caller's trouble stays its own, through real gRPC: while one tenant sends every
hostile-but-valid token choice (repetition penalties from the smallest positive float
to the largest) and decodes a sequence whose KV state is corrupt, another tenant
decodes greedily and decodes ahead in the same forwards, and every one of its calls
is served.  The hostile calls get a defined answer (a token) or a typed error
(NON_FINITE_LOGITS) and change nothing when they fail."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy, TokenChoice
from ferrum_rpc.errors import NonFiniteLogits, Reason
from tests.conftest import TENANT_TOKENS, tenants_server

ALICE, BOB = TENANT_TOKENS["alice"], TENANT_TOKENS["bob"]
PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]
HOSTILE = [TokenChoice(temperature=t, top_k=k, top_p=p, seed=3 + n, repetition_penalty=r, top_logprobs=2)
           for n, (r, t, k, p) in enumerate([(1.4e-45, 1.0, 0, 1.0), (1e-40, 1.0, 20, 1.0), (1e-38, 0.7, 0, 0.9),
                                             (1e-38, 0.0, 0, 1.0), (3.4e38, 1.0, 0, 1.0), (1e30, 1e-5, 5, 1.0)])]


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with tenants_server(tiny_llama_dir, tmp_path_factory, batch_wait_ms=2) as srv:
        yield srv


def _alice_hostile(target: str, vocab: int, failures: list) -> None:
    """Every hostile policy on every request shape; each must answer with a token."""
    with ExecutorClient(target, timeout=30, token=ALICE) as alice:
        for _ in range(3):
            for choice in HOSTILE:
                try:
                    out = alice.prefill(PROMPT, token_choice=choice)
                    handle, token = out.kv_cache, out.chosen.token_id
                    out = alice.decode(token, handle, token_choice=choice)
                    other = alice.prefill(PROMPT[:5], logits=LogitsPolicy.argmax()).kv_cache
                    outs = alice.batch_decode([DecodeInput(out.chosen.token_id, out.kv_cache, choice),
                                               DecodeInput(3, other, choice)])
                    run = alice.decode_ahead(outs[0].chosen.token_id, outs[0].kv_cache, choice, 6)
                    tokens = [out.chosen.token_id] + [o.chosen.token_id for o in outs] + [c.token_id for c in run.chosen]
                    assert all(0 <= t < vocab for t in tokens) and len(run.chosen) == 6, tokens
                    alice.release_cache(run.kv_cache)
                    alice.release_cache(outs[1].kv_cache)
                except Exception as exc:  # reported to the test thread
                    failures.append(f"alice {choice.repetition_penalty:g}: {exc!r}")


def test_hostile_token_choices_are_served_and_fail_nobody_else(server):
    with ExecutorClient(server.target, timeout=30, token=BOB) as bob:
        vocab = bob.info().vocab_size
        failures: list[str] = []
        hostile = threading.Thread(target=_alice_hostile, args=(server.target, vocab, failures))
        hostile.start()
        served = 0
        while hostile.is_alive():
            out = bob.prefill(PROMPT[::-1], token_choice=TokenChoice.greedy())
            for _ in range(8):
                out = bob.decode(out.chosen.token_id, out.kv_cache, token_choice=TokenChoice.greedy())
                served += 1
            run = bob.decode_ahead(out.chosen.token_id, out.kv_cache, TokenChoice(temperature=1.0, seed=9), 12)
            assert len(run.chosen) == 12
            bob.release_cache(run.kv_cache)
        hostile.join()
        assert failures == []
        assert served >= 8


def _poison(server, cache_id: str) -> None:
    """Writes NaN over a sequence's K in every layer, on the worker thread (corrupt state,
    as a bad import or a faulty device would leave it)."""
    worker = server.app.servicer.gate.workers["tiny"]
    ex = worker.executor
    blocks = lambda: torch.tensor(ex.kv.get(cache_id).block_ids, device=ex.pool.k.device)  # noqa: E731
    worker.submit(lambda: ex.pool.k.index_fill_(1, blocks(), float("nan"))).result(10)


def test_non_finite_logits_fail_their_own_call_alone_with_their_own_reason(server):
    with ExecutorClient(server.target, timeout=30, token=ALICE) as alice, \
            ExecutorClient(server.target, timeout=30, token=BOB) as bob:
        bad = alice.prefill(PROMPT, logits=LogitsPolicy.argmax()).kv_cache
        _poison(server, bad.cache_id)
        mine = bob.prefill(PROMPT, logits=LogitsPolicy.argmax()).kv_cache
        errors: list = []

        def hammer():
            for choice in [TokenChoice.greedy(), TokenChoice(temperature=1.0, seed=1),
                           TokenChoice(temperature=0.8, top_k=10, seed=2), TokenChoice(temperature=1.0, top_p=0.8)] * 5:
                try:
                    alice.decode(4, bad, token_choice=choice)
                except NonFiniteLogits as exc:
                    errors.append(exc)

        thread = threading.Thread(target=hammer)
        thread.start()
        handle = mine
        while thread.is_alive() or handle is mine:
            out = bob.decode(5, handle, token_choice=TokenChoice(temperature=1.0, seed=4))
            handle = out.kv_cache
        thread.join()
        assert len(errors) == 20
        assert errors[0].code is grpc.StatusCode.FAILED_PRECONDITION and errors[0].reason is Reason.NON_FINITE_LOGITS
        # nothing changed: the handle still names the sequence at its length
        assert alice.truncate_kv(bad, bad.sequence_length).sequence_length == bad.sequence_length
        # the caller's way out: truncate to before the bad state (here: nothing is left) or release
        alice.release_cache(bad)
        bob.release_cache(handle)
