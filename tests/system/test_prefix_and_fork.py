"""Shared-prefix KV reuse and forked sequences, through real gRPC."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from tests.conftest import running_server

ATOL = 1e-4
SYSTEM = [(13 * i + 5) % 320 for i in range(23)]  # a shared "system prompt": 5 full blocks of 4


@pytest.fixture(scope="module")
def cached_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, kv_tokens=512, block_size=4) as server:
        yield server


@pytest.fixture(scope="module")
def uncached_server(tiny_llama_dir):
    with running_server(tiny_llama_dir, kv_tokens=512, block_size=4, prefix_caching=False) as server:
        yield server


def test_common_prefix_is_served_from_cache_with_equal_logits(cached_server, uncached_server):
    first_prompt, second_prompt = SYSTEM + [7, 8, 9], SYSTEM + [100, 101]
    with ExecutorClient(cached_server.target) as ex, ExecutorClient(uncached_server.target) as plain:
        before = ex.status()
        first = ex.prefill(first_prompt)
        second = ex.prefill(second_prompt)
        assert first.cached_tokens == 0
        assert second.cached_tokens == 20  # the 5 full blocks of the common 23 tokens
        shared = set(first.kv_cache.block_table.block_ids) & set(second.kv_cache.block_table.block_ids)
        assert len(shared) == 5

        status = ex.status()
        assert status.kv_blocks_shared == before.kv_blocks_shared + 5
        assert status.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens == 20
        assert status.prefix_cache_hit_rate > 0

        uncached = plain.prefill(second_prompt)
        np.testing.assert_allclose(second.logits.values, uncached.logits.values, atol=ATOL, rtol=0)
        # decoding on top of shared blocks agrees too
        a = ex.decode(42, second.kv_cache)
        b = plain.decode(42, uncached.kv_cache)
        np.testing.assert_allclose(a.logits.values, b.logits.values, atol=ATOL, rtol=0)
        plain.release_cache(b.kv_cache)

        ex.release_cache(first.kv_cache)
        assert ex.status().kv_blocks_shared == before.kv_blocks_shared  # the second still holds them
        ex.release_cache(a.kv_cache)
        after = ex.status()
        assert after.kv_blocks_used == before.kv_blocks_used and after.active_sequences == before.active_sequences


def test_released_prefix_is_reused_later(cached_server):
    with ExecutorClient(cached_server.target) as ex:
        prompt = SYSTEM + [1, 2, 3, 4, 5, 6]
        first = ex.prefill(prompt)
        ex.release_cache(first.kv_cache)
        again = ex.prefill(prompt)
        assert again.cached_tokens == 28  # 7 full blocks; the last block's tokens are recomputed
        np.testing.assert_allclose(again.logits.values, first.logits.values, atol=ATOL, rtol=0)
        ex.release_cache(again.kv_cache)


def test_all_positions_prefill_bypasses_the_cache(cached_server):
    with ExecutorClient(cached_server.target) as ex:
        a = ex.prefill(SYSTEM, logits=LogitsPolicy.full(all_positions=True))
        b = ex.prefill(SYSTEM, logits=LogitsPolicy.full(all_positions=True))
        assert b.cached_tokens == 0 and b.logits.values.shape == (len(SYSTEM), 320)
        np.testing.assert_allclose(a.logits.values, b.logits.values, atol=ATOL, rtol=0)
        ex.release_cache(a.kv_cache)
        ex.release_cache(b.kv_cache)


def test_truncating_into_a_shared_block_copies_it(cached_server, uncached_server):
    with ExecutorClient(cached_server.target) as ex, ExecutorClient(uncached_server.target) as plain:
        keep = ex.prefill(SYSTEM + [9])
        other = ex.prefill(SYSTEM + [9])  # shares the 5 full blocks
        short = ex.truncate_kv(other.kv_cache, 10)  # ends inside a shared block
        step = ex.decode(77, short)  # must not overwrite `keep`'s block
        assert step.kv_cache.block_table.block_ids[2] not in keep.kv_cache.block_table.block_ids
        ref = plain.prefill(SYSTEM[:10] + [77])
        np.testing.assert_allclose(step.logits.values, ref.logits.values, atol=ATOL, rtol=0)
        again = plain.decode(5, plain.prefill(SYSTEM + [9]).kv_cache)
        np.testing.assert_allclose(ex.decode(5, keep.kv_cache).logits.values, again.logits.values,
                                   atol=ATOL, rtol=0)
        ex.release_cache(step.kv_cache)
        ex.release_cache(keep.kv_cache.cache_id)
        plain.release_cache(ref.kv_cache)
        plain.release_cache(again.kv_cache)


@pytest.mark.parametrize("order", list(itertools.permutations(range(5)))[::17])
def test_fork_children_equal_independent_sequences_and_release_in_any_order(cached_server, uncached_server, order):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]  # 10 tokens: the last block is partial, so forks must copy it
    children_tokens = [[11, 12], [21, 22], [31, 32], [41, 42]]
    with ExecutorClient(cached_server.target) as ex, ExecutorClient(uncached_server.target) as plain:
        before = ex.status()
        parent = ex.prefill(prompt).kv_cache
        children = ex.fork_cache(parent, 4)
        assert len({c.cache_id for c in children} | {parent.cache_id}) == 5
        assert all(c.block_table == parent.block_table and c.sequence_length == 10 for c in children)

        handles = list(children)
        for step in range(2):
            outs = ex.batch_decode([(toks[step], h) for toks, h in zip(children_tokens, handles)])
            handles = [o.kv_cache for o in outs]
            for toks, out in zip(children_tokens, outs):
                ref = plain.prefill(prompt + toks[: step + 1])
                np.testing.assert_allclose(out.logits.values, ref.logits.values, atol=ATOL, rtol=0)
                plain.release_cache(ref.kv_cache)
        # the parent is untouched by its children's writes
        parent_step = ex.decode(99, parent)
        ref = plain.prefill(prompt + [99])
        np.testing.assert_allclose(parent_step.logits.values, ref.logits.values, atol=ATOL, rtol=0)
        plain.release_cache(ref.kv_cache)

        everyone = [parent_step.kv_cache] + handles
        for i in order:
            ex.release_cache(everyone[i])
        after = ex.status()
        assert after.kv_blocks_used == before.kv_blocks_used, "leaked KV blocks"
        assert after.active_sequences == before.active_sequences


def test_fork_validation(cached_server):
    from ferrum_rpc.client import InvalidInput

    with ExecutorClient(cached_server.target) as ex:
        parent = ex.prefill([1, 2, 3]).kv_cache
        used = ex.status().kv_blocks_used
        with pytest.raises(InvalidInput):
            ex.fork_cache(parent, 0)
        assert ex.status().kv_blocks_used == used
        ex.release_cache(parent)
