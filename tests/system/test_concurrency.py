"""Many callers at once, idle expiry, DecodeSession streams and disconnects, server-side chunking."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import CacheExpired, CacheNotFound, LengthMismatch, Reason
from tests.conftest import running_server
from tests.waiting import wait_for

ATOL = 1e-4


def _prompt(i: int) -> list[int]:
    return [(31 * i + 7 * j + 3) % 320 for j in range(3 + i % 9)]


def test_concurrent_callers_get_exactly_their_own_logits(tiny_llama_dir):
    callers, steps = 16, 8
    with running_server(tiny_llama_dir, batch_wait_ms=2) as server:
        # the same work, alone, one caller at a time
        with ExecutorClient(server.target) as ex:
            alone = []
            for i in range(callers):
                handle, rows = ex.prefill(_prompt(i)).kv_cache, []
                for t in range(steps):
                    out = ex.decode((i * 11 + t) % 320, handle)
                    handle, rows = out.kv_cache, rows + [out.logits.values[0]]
                ex.release_cache(handle)
                alone.append(rows)

        barrier = threading.Barrier(callers)
        batch_sizes: list[int] = []

        def caller(i: int) -> list[np.ndarray]:
            with ExecutorClient(server.target) as ex:
                handle, rows = ex.prefill(_prompt(i)).kv_cache, []
                barrier.wait()
                for t in range(steps):
                    out = ex.decode((i * 11 + t) % 320, handle)
                    handle, rows = out.kv_cache, rows + [out.logits.values[0]]
                    batch_sizes.append(out.timing.batch_size)
                ex.release_cache(handle)
                return rows

        with ThreadPoolExecutor(callers) as pool:
            together = list(pool.map(caller, range(callers)))
        for i in range(callers):
            for t in range(steps):
                np.testing.assert_allclose(together[i][t], alone[i][t], atol=ATOL, rtol=0)
        assert max(batch_sizes) > 1, "concurrent decodes were never coalesced"


def test_idle_sequences_expire_with_cache_expired(tiny_llama_dir):
    with running_server(tiny_llama_dir, idle_timeout_s=0.5) as server, ExecutorClient(server.target) as ex:
        assert ex.capabilities().idle_timeout_s == 0.5
        idle = ex.prefill([1, 2, 3]).kv_cache
        busy = ex.prefill([4, 5, 6]).kv_cache

        def use_busy() -> int:  # keeps one sequence in use until the reaper took the other
            nonlocal busy
            busy = ex.decode(7, busy).kv_cache
            return ex.status().sequences_expired

        wait_for(use_busy, 10, "the idle sequence to expire")
        with pytest.raises(CacheExpired) as info:
            ex.decode(7, idle)
        assert info.value.reason is Reason.CACHE_EXPIRED and isinstance(info.value, CacheNotFound)
        status = ex.status()
        assert status.sequences_expired >= 1 and status.active_sequences == 1
        ex.release_cache(busy)
        assert ex.status().kv_blocks_used == 0


def test_decode_session_matches_unary_decode(client):
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4]]
    expected = []
    for p in prompts:
        h = client.prefill(p).kv_cache
        rows = []
        for t in (10, 11, 12):
            out = client.decode(t, h)
            h, rows = out.kv_cache, rows + [out.logits.values[0]]
        client.release_cache(h)
        expected.append(rows)
    handles = [client.prefill(p).kv_cache for p in prompts]
    stale = handles[0]
    with client.decode_session() as session:
        for step, t in enumerate((10, 11, 12)):
            outs = session.step([(t, h) for h in handles])  # two sequences share the stream
            handles = [o.kv_cache for o in outs]
            for seq, out in enumerate(outs):
                np.testing.assert_allclose(out.logits.values[0], expected[seq][step], atol=ATOL, rtol=0)
        with pytest.raises(LengthMismatch):  # a failed step does not end the session
            session.step([(5, handles[1]), (5, stale)])
        out = session.step([(13, handles[0])], logits=LogitsPolicy.topk(3))[0]
        assert out.kv_cache.sequence_length == len(prompts[0]) + 4
        again = session.step([(5, handles[1])])[0]  # untouched by the failed step
        assert again.kv_cache.sequence_length == len(prompts[1]) + 4
    client.release_cache(again.kv_cache)
    client.release_cache(out.kv_cache)


def test_disconnect_mid_session_loses_nothing_of_other_sequences(tiny_server):
    with ExecutorClient(tiny_server.target) as survivor:
        mine = survivor.prefill([5, 6, 7]).kv_cache
        reference = survivor.prefill([5, 6, 7]).kv_cache
        quitter = ExecutorClient(tiny_server.target)
        theirs = quitter.prefill([1, 1, 1]).kv_cache
        servicer = tiny_server.app.servicer
        others = set(servicer.sessions)
        session = quitter.decode_session()
        session.step([(3, theirs)])
        (theirs_session,) = set(servicer.sessions) - others
        quitter.close()  # drops the stream without ending it
        wait_for(lambda: theirs_session in servicer.sessions, 10, "the server to end the dropped session",
                 until=lambda still: not still)
        a = survivor.decode(8, mine)
        b = survivor.decode(8, reference)
        np.testing.assert_allclose(a.logits.values, b.logits.values, atol=ATOL, rtol=0)
        assert survivor.status().active_sequences >= 3  # the quitter's sequence is kept until released/expired
        survivor.release_cache(theirs.cache_id)
        for h in (a.kv_cache, b.kv_cache):
            survivor.release_cache(h)


def test_server_side_chunked_prefill_matches_transformers(tiny_llama_dir, hf_tiny_llama):
    prompt = [(17 * j + 1) % 320 for j in range(23)]
    with torch.no_grad():
        ref = hf_tiny_llama(torch.tensor([prompt])).logits[0].numpy()
    with running_server(tiny_llama_dir, prefill_chunk=5) as server, ExecutorClient(server.target) as ex:
        assert ex.capabilities().prefill_chunk_tokens == 5
        last = ex.prefill(prompt)
        np.testing.assert_allclose(last.logits.values[0], ref[-1], atol=ATOL, rtol=0)
        every = ex.prefill(prompt, logits=LogitsPolicy.full(all_positions=True))
        np.testing.assert_allclose(every.logits.values, ref, atol=ATOL, rtol=0)


def test_chunked_prefill_lets_decodes_through(tiny_llama_dir):
    """A long prefill in small chunks does not hold other callers' decodes until it ends."""
    long_prompt = [(7 * j) % 320 for j in range(240)]
    with running_server(tiny_llama_dir, prefill_chunk=8, kv_tokens=4096) as server, \
            ExecutorClient(server.target) as ex:
        handle = ex.prefill([1, 2, 3]).kv_cache
        done = threading.Event()
        decodes_during = 0

        def long_prefill():
            with ExecutorClient(server.target) as other:
                other.prefill(long_prompt, logits=LogitsPolicy.full(all_positions=True))
            done.set()

        thread = threading.Thread(target=long_prefill)
        thread.start()
        while not done.is_set():
            handle = ex.decode(4, handle).kv_cache
            decodes_during += 1
        thread.join()
        assert decodes_during >= 3, "decodes were stalled behind the chunked prefill"


def test_kv_pool_sized_by_memory_fraction(tiny_llama_dir):
    import os

    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_token = 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, head_dim 16, float32
    with running_server(tiny_llama_dir, kv_memory_fraction=0.0005) as server, ExecutorClient(server.target) as ex:
        caps = ex.capabilities()
        expected = available * 0.0005 / per_token
        assert 0.5 * expected <= caps.kv_capacity_tokens <= 1.5 * expected  # free memory moves a little
        # the pool's memory: its capacity plus one scratch block for padded batch rows
        assert caps.kv_bytes == (caps.kv_capacity_tokens + caps.kv_block_size) * per_token
        assert ex.status().kv_blocks_total == caps.kv_num_blocks


def test_async_decode_session_and_fork(tiny_server):
    import asyncio

    from ferrum_rpc.client import AsyncExecutorClient

    async def scenario():
        async with AsyncExecutorClient(tiny_server.target, timeout=30) as ex:
            parent = (await ex.prefill([2, 4, 6, 8, 10])).kv_cache
            a, b = await ex.fork_cache(parent, 2)
            async with ex.decode_session() as session:
                first = await session.step([(1, a), (2, b)])
                with pytest.raises(LengthMismatch):
                    await session.step([(3, a)])  # stale: the session goes on
                second = await session.step([(3, first[0].kv_cache)])
            ref = await ex.decode(3, (await ex.decode(1, (await ex.prefill([2, 4, 6, 8, 10])).kv_cache)).kv_cache)
            for h in (parent, first[1].kv_cache, second[0].kv_cache, ref.kv_cache):
                await ex.release_cache(h)
            return second[0], ref

    got, ref = asyncio.run(scenario())
    assert got.kv_cache.sequence_length == 7
    np.testing.assert_allclose(got.logits.values, ref.logits.values, atol=ATOL, rtol=0)


def test_concurrent_prefills_share_forwards_and_match_alone(tiny_llama_dir, hf_tiny_llama):
    """Prompts of different lengths arriving together share ragged forwards, each exact."""
    from ferrum_rpc.client import InvalidInput

    prompts = [[(11 * i + 5 * j) % 320 for j in range(3 + 4 * i)] for i in range(8)]
    with running_server(tiny_llama_dir, prefill_chunk=64) as server:
        barrier = threading.Barrier(len(prompts) + 1)

        def caller(i: int):
            with ExecutorClient(server.target) as ex:
                barrier.wait()
                if i == len(prompts):  # a bad prompt in the same burst fails alone
                    with pytest.raises(InvalidInput):
                        ex.prefill([1, 10_000])
                    return None
                policy = LogitsPolicy.full(all_positions=(i % 2 == 0))
                out = ex.prefill(prompts[i], logits=policy)
                step = ex.decode(7, out.kv_cache)
                ex.release_cache(step.kv_cache)
                return out, step

        with ThreadPoolExecutor(len(prompts) + 1) as pool:
            results = list(pool.map(caller, range(len(prompts) + 1)))[:-1]
        assert max(out.timing.batch_size for out, _ in results) > 1, "prefills were never batched"
        with ExecutorClient(server.target) as ex:
            assert ex.status().active_sequences == 0 and ex.status().kv_blocks_used == 0
        for i, (out, step) in enumerate(results):
            with torch.no_grad():
                ref = hf_tiny_llama(torch.tensor([prompts[i] + [7]])).logits[0].numpy()
            expected = ref[:-1] if i % 2 == 0 else ref[-2:-1]
            np.testing.assert_allclose(out.logits.values, expected, atol=ATOL, rtol=0)
            np.testing.assert_allclose(step.logits.values[0], ref[-1], atol=ATOL, rtol=0)
