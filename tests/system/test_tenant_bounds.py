"""Per-tenant bounds by default: with --auth-tokens and no tenant flags, one
tenant may hold at most half the live sequences (--max-sequences), half the KV pool and
a quarter of --max-batch sequences decoding ahead; past each it is refused
RESOURCE_EXHAUSTED with a message naming the bound and its flag, while another tenant
is served.  GetStatus shows the bounds.  Real gRPC on a real server."""

from __future__ import annotations

import pytest

from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy, TokenChoice
from ferrum_rpc.errors import ExecutorError, Reason, SequenceLimitExceeded, TenantQuotaExceeded
from tests.conftest import TENANT_TOKENS, running_server, tenants_server

ALICE, BOB = TENANT_TOKENS["alice"], TENANT_TOKENS["bob"]
ARGMAX = LogitsPolicy.argmax()
GREEDY = TokenChoice(temperature=0.0)
# a pool of 256 tokens in blocks of 4, 12 live sequences, forwards of 8: by default a
# tenant may hold 6 sequences, 128 KV tokens and 2 sequences decoding ahead
LIMITS = dict(kv_tokens=256, block_size=4, max_sequences=12, max_batch_size=8)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    with tenants_server(tiny_llama_dir, tmp_path_factory, **LIMITS) as srv:
        yield srv


def test_status_shows_the_default_bounds(alice):
    status = alice.status()
    assert (status.tenant_max_sequences, status.tenant_kv_tokens, status.tenant_ahead_sequences) == (6, 128, 2)


def test_a_tenant_past_half_the_sequences_is_refused_and_another_is_served(alice, bob):
    handles = [alice.prefill([1, 2, 3], logits=ARGMAX).kv_cache for _ in range(6)]
    with pytest.raises(SequenceLimitExceeded, match=r"holds 6 live sequences, its cap is 6 \(--tenant-max-sequences"):
        alice.prefill([1, 2, 3], logits=ARGMAX)
    other = bob.prefill([1, 2, 3], logits=ARGMAX).kv_cache
    for h in [*handles, other]:
        (alice if h in handles else bob).release_cache(h)


def test_a_tenant_past_half_the_pool_is_refused_and_another_is_served(alice, bob):
    prompt = list(range(1, 41))  # 10 blocks each
    held = [alice.prefill([t + 40 * n for t in prompt], logits=ARGMAX).kv_cache for n in range(3)]  # 120 tokens
    with pytest.raises(TenantQuotaExceeded, match=r"over its quota of 128 \(--tenant-kv-tokens"):
        alice.prefill([t + 160 for t in prompt], logits=ARGMAX)
    other = bob.prefill([t + 200 for t in prompt], logits=ARGMAX).kv_cache  # the pool has room for bob
    assert other.sequence_length == 40
    for h in held:
        alice.release_cache(h)
    bob.release_cache(other)


def test_a_tenant_past_its_decode_ahead_share_is_refused_and_another_is_served(server, alice, bob):
    """Two of alice's sequences decode ahead in a run its caller does not read (the
    receive window is 1 KiB: the run pauses); a third one is refused, bob's run goes on."""
    paused_options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    choice = TokenChoice(temperature=0.0, top_logprobs=20)
    with ExecutorClient(server.target, timeout=30, token=ALICE, channel_options=paused_options) as slow:
        outs = [slow.prefill([5, 6, 7 + n], token_choice=choice) for n in range(3)]
        with slow.decode_session() as held, alice.decode_session() as session:
            first = held.decode_ahead([DecodeInput(o.chosen.token_id, o.kv_cache, choice) for o in outs[:2]], 200)
            next(iter(first))  # running
            third = session.decode_ahead([DecodeInput(outs[2].chosen.token_id, outs[2].kv_cache, choice)], 5)
            with pytest.raises(ExecutorError) as refused:
                third.wait()
            assert refused.value.reason is Reason.TENANT_QUOTA_EXCEEDED
            assert "2 sequences decoding ahead, its cap is 2 (--tenant-ahead-sequences" in refused.value.message
            assert alice.status().ahead_sequences == 2
            mine = bob.prefill([9, 10, 11], token_choice=GREEDY)
            tokens = bob.decode_ahead(mine.chosen.token_id, mine.kv_cache, GREEDY, 20)
            assert len(tokens.chosen) == 20
            first.stop()
            first.wait()
        bob.release_cache(tokens.kv_cache)
        for o in outs:
            slow.release_cache(o.kv_cache)


def test_sequences_decoding_ahead_are_bounded_in_total_too(tiny_llama_dir):
    """No tokens (one anonymous caller, no per-tenant share): decode-ahead runs may hold
    at most --max-batch sequences at once; the next is refused, and served once one ends."""
    paused_options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    choice = TokenChoice(temperature=0.0, top_logprobs=20)
    with running_server(tiny_llama_dir, max_batch_size=2) as srv, \
            ExecutorClient(srv.target, timeout=30, channel_options=paused_options) as slow, \
            ExecutorClient(srv.target, timeout=30) as other:
        outs = [slow.prefill([5, 6, 7 + n], token_choice=choice) for n in range(3)]
        with slow.decode_session() as held:
            first = held.decode_ahead([DecodeInput(o.chosen.token_id, o.kv_cache, choice) for o in outs[:2]], 200)
            next(iter(first))  # running, and soon paused: nobody reads it
            with pytest.raises(SequenceLimitExceeded, match=r"2 sequences decoding ahead, its cap is 2 \(--max-batch"):
                other.decode_ahead(outs[2].chosen.token_id, outs[2].kv_cache, choice, 5)
            first.stop()
            first.wait()
        run = other.decode_ahead(outs[2].chosen.token_id, outs[2].kv_cache, choice, 5)
        assert len(run.chosen) == 5
