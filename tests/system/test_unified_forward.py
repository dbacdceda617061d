"""The unified forward: prompt parts and decodes of different sequences share
one ragged forward under a token budget, and each sequence's logits equal
transformers' on that sequence alone (float32, 1e-4), for Llama, Qwen3 and
Qwen3-MoE; the worker schedules decodes first, then prompt parts up to the
budget; a failed or abandoned prompt leaves nothing behind."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, KvCapacityExhausted, LogitsPolicy
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor, verify_policy
from ferrum_rpc.server.engine.worker import ModelWorker
from ferrum_rpc.types import DecodeInput
from tests.conftest import executor_snapshot as snapshot
from tests.conftest import oracle_rows as oracle
from tests.conftest import running_server
from tests.waiting import wait_for_async

FULL = LogitsPolicy.full()
ATOL = 1e-4
MODELS = ["llama", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="module", params=MODELS)
def model(request, tiny_llama_dir, tiny_qwen3_dir, tiny_moe_dir):
    """(name, folder, the transformers oracle on the same weights)."""
    from transformers import AutoModelForCausalLM

    folder = {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "qwen3_moe": tiny_moe_dir}[request.param]
    return request.param, folder, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("kernels", [("auto", "auto"), ("eager", "aten")], ids=["probed", "fallbacks"])
def test_prompt_parts_and_decodes_share_forwards_and_each_equals_transformers(model, kernels):
    """Four ragged forwards, each carrying decodes of two sequences (one a fork
    child) beside parts of a new prompt that starts from a cached prefix and of
    a continuation of the other fork child; parts end inside KV blocks,
    including the block the fork children share (copied on its first write).
    On the probed fast paths (fused step ops, packed linears where they run
    here) and on the fallbacks every CPU has."""
    _, folder, hf = model
    step_ops, linear = kernels
    ex = TorchExecutor.from_path("tiny", folder, ExecutorConfig(kv_tokens=512, block_size=4, prefill_chunk=5,
                                                                step_ops=step_ops, linear_kernel=linear))
    q = [5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 12, 13]
    ex.prefill(q, None, LogitsPolicy.argmax())  # its 3 full blocks are now in the prefix cache
    a = [64, 2, 77, 8, 8, 13, 21, 34, 55, 89]  # 10 tokens: block 2 half full, shared after the fork
    parent = ex.prefill(a, None, LogitsPolicy.argmax()).kv_cache
    a1, a2 = ex.fork_cache(parent, 2)
    ex.release_cache(parent.cache_id)
    b = [9, 300, 11, 4, 44, 144, 3]
    hb = ex.prefill(b, None, LogitsPolicy.argmax()).kv_cache

    p = q[:9] + [31, 41, 59, 26, 53, 58, 97, 93, 23, 84, 62, 64, 33, 83, 27, 95, 2]  # 26 tokens, 8 from the cache
    prompt = ex.open_prefill(p, None, FULL)
    assert prompt.offset == 8
    c = [6, 28, 49, 71, 111, 222, 123, 45, 67]  # continues fork child a1, every position back
    cont = ex.open_prefill(c, a1, verify_policy(FULL))

    seqs = {"a2": (a2, list(a)), "b": (hb, list(b))}
    decoded = {"a2": [70, 71, 72, 73], "b": [80, 81, 82, 83]}
    prompt_parts, cont_parts = [3, 5, 5, 3], [2, 5, 2]  # prompt: 8->11->16->21->24, the rest below
    outputs = {}
    for step in range(4):
        forwards = ex.stats.forwards
        plans = [ex.plan_decode([DecodeInput(decoded[k][step], seqs[k][0]) for k in seqs], FULL)]
        parts = [(prompt, prompt.next_part(prompt_parts[step]))]
        if step < len(cont_parts):
            parts.append((cont, cont.next_part(cont_parts[step])))
        results = ex.run(plans + [plan for _, plan in parts])
        assert ex.stats.forwards == forwards + 1  # one forward for everything
        for k, out in zip(seqs, results[0]):
            seqs[k][1].append(decoded[k][step])
            seqs[k] = (out.kv_cache, seqs[k][1])
            np.testing.assert_allclose(out.logits.values[0], oracle(hf, seqs[k][1])[-1], atol=ATOL, rtol=0)
        for (owner, plan), rows in zip(parts, results[1:]):
            if (done := owner.part_done(plan, rows)) is not None:
                outputs[id(owner)] = done
    plan = prompt.next_part(5)  # the last two tokens, alone
    outputs[id(prompt)] = prompt.part_done(plan, ex.run([plan])[0])

    got_prompt, got_cont = outputs[id(prompt)], outputs[id(cont)]
    assert got_prompt.cached_tokens == 8 and got_prompt.kv_cache.sequence_length == len(p)
    np.testing.assert_allclose(got_prompt.logits.values[0], oracle(hf, p)[-1], atol=ATOL, rtol=0)
    assert got_cont.kv_cache.sequence_length == len(a) + len(c)
    np.testing.assert_allclose(got_cont.logits.values, oracle(hf, a + c)[-len(c):], atol=ATOL, rtol=0)
    # the fork children never saw each other's writes to the block they shared
    a2_out = ex.decode(1, seqs["a2"][0], FULL)
    np.testing.assert_allclose(a2_out.logits.values[0], oracle(hf, seqs["a2"][1] + [1])[-1], atol=ATOL, rtol=0)


def test_a_failing_ragged_forward_undoes_every_part_of_every_prompt(tiny_llama_dir):
    ex = TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=512, block_size=4,
                                                                       prefill_chunk=5))
    h = ex.prefill([5, 6, 7], None, LogitsPolicy.argmax()).kv_cache
    before = snapshot(ex)
    prompt = ex.open_prefill(list(range(1, 15)), None, FULL)
    plan = prompt.next_part(5)
    prompt.part_done(plan, ex.run([plan])[0])  # one part in
    plans = [ex.plan_decode([DecodeInput(9, h)], FULL), prompt.next_part(5)]
    real_logits = ex.model.logits

    def broken(hidden):
        raise RuntimeError("injected LM-head failure")

    ex.model.logits = broken
    try:
        with pytest.raises(RuntimeError, match="injected"):
            ex.run(plans)
    finally:
        ex.model.logits = real_logits
    prompt.abandon()
    prompt.abandon()  # twice is harmless
    assert snapshot(ex) == before


def _worker(folder, **config) -> ModelWorker:
    worker = ModelWorker(lambda: TorchExecutor.from_path("tiny", folder, ExecutorConfig(
        kv_tokens=1024, block_size=4, **config)))
    worker.loaded.result(60)
    return worker


@pytest.mark.parametrize("budget, forwards, tokens", [
    (8, 3, [8, 8, 7]),  # 3 decodes + 5 prompt tokens, then (decoders active) the budget, then the rest
    (0, 3, [16, 3, 4]),  # the pre-unified schedule: a prompt chunk alone, the decodes, the rest
])
def test_worker_puts_decodes_first_then_prompt_parts_up_to_the_budget(model, budget, forwards, tokens):
    _, folder, hf = model
    worker = _worker(folder, prefill_chunk=16, step_token_budget=budget)
    ex = worker.executor
    try:
        starts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
        handles = [worker.submit(ex.prefill, s, None, LogitsPolicy.argmax()).result(30).kv_cache for s in starts]
        prompt = [(3 * i + 1) % 300 for i in range(20)]
        gate = threading.Event()

        async def scenario():
            worker.submit(gate.wait, 30)  # holds the worker while the queue fills
            before = (ex.stats.forwards, ex.stats.tokens_processed)
            prefill = asyncio.ensure_future(worker.front.prefill(prompt, None, FULL))
            await wait_for_async(lambda: worker.work_queued, 10, "the prompt queued", until=lambda n: n == 1)
            decodes = [asyncio.ensure_future(worker.front.decode([DecodeInput(100 + i, h)], FULL))
                       for i, h in enumerate(handles)]
            await wait_for_async(lambda: worker.work_queued, 10, "the prompt and the decodes queued",
                                 until=lambda n: n == 1 + len(handles))
            gate.set()
            results = await asyncio.gather(prefill, *decodes)
            return before, results

        (forwards0, tokens0), ((out, _), *decoded) = asyncio.run(scenario())
        assert ex.stats.forwards - forwards0 == forwards
        assert ex.stats.tokens_processed - tokens0 == sum(tokens)
        np.testing.assert_allclose(out.logits.values[0], oracle(hf, prompt)[-1], atol=ATOL, rtol=0)
        for i, (((step,), _), start) in enumerate(zip(decoded, starts)):
            np.testing.assert_allclose(step.logits.values[0], oracle(hf, start + [100 + i])[-1], atol=ATOL, rtol=0)
        if budget:
            assert decoded[0].out[0].timing.batch_size == 4  # three decodes and the prompt's part, one forward
    finally:
        worker.stop(30)


def test_a_prompt_abandoned_between_parts_is_undone_while_decodes_go_on(tiny_llama_dir):
    worker = _worker(tiny_llama_dir, prefill_chunk=4, step_token_budget=6)
    ex = worker.executor
    try:
        h = worker.submit(ex.prefill, [5, 6, 7], None, LogitsPolicy.argmax()).result(30).kv_cache

        async def scenario():
            snap = await worker.front.call(snapshot, ex)
            gate = threading.Event()
            worker.submit(gate.wait, 30)
            prefill = asyncio.ensure_future(worker.front.prefill(list(range(1, 200)), None, FULL))
            await wait_for_async(lambda: worker.work_queued, 10, "the prompt queued", until=lambda n: n == 1)
            gate.set()
            handle, steps = h, 0
            while steps < 3 or ex.kv.count("") < 2:  # the prompt is open and has parts in
                (out,), _ = await worker.front.decode([DecodeInput(9, handle)], LogitsPolicy.argmax())
                handle, steps = out.kv_cache, steps + 1
            prefill.cancel()
            with pytest.raises(asyncio.CancelledError):
                await prefill
            await wait_for_async(lambda: worker.front.call(lambda: ex.kv.count("")), 10,  # undone at the worker's next turn
                                 "one live sequence (the abandoned prompt undone)", until=lambda n: n == 1)
            await worker.front.call(ex.truncate_kv, handle, 3)
            return snap, await worker.front.call(snapshot, ex)

        before, after = asyncio.run(scenario())
        assert before["used"] == after["used"] and before["free"] == after["free"]
        assert {cid: s[:3] for cid, s in before["seqs"].items()} == {cid: s[:3] for cid, s in after["seqs"].items()}
    finally:
        worker.stop(30)


def test_many_callers_decoding_while_prompts_arrive_over_grpc_equal_transformers(tiny_llama_dir, hf_tiny_llama):
    """Real gRPC: three callers decode greedily while two send 40-60-token prompts;
    every logits row equals transformers on its own sequence."""
    errors: list[BaseException] = []
    with running_server(tiny_llama_dir, prefill_chunk=8, step_token_budget=12) as server:
        def decoder(i: int) -> None:
            try:
                with ExecutorClient(server.target, timeout=60) as c:
                    ids = [7 + i, 8 + i, 9 + i]
                    out = c.prefill(ids, logits=FULL)
                    handle, token = out.kv_cache, int(out.logits.values[0].argmax())
                    for _ in range(12):
                        ids.append(token)
                        step = c.decode(token, handle, FULL)
                        np.testing.assert_allclose(step.logits.values[0], oracle(hf_tiny_llama, ids)[-1], atol=ATOL,
                                                   rtol=0)
                        handle, token = step.kv_cache, int(step.logits.values[0].argmax())
                    c.release_cache(handle)
            except BaseException as exc:
                errors.append(exc)

        def prompter(i: int) -> None:
            try:
                with ExecutorClient(server.target, timeout=60) as c:
                    for n in (40, 60):
                        ids = [(11 * j + i) % 300 + 1 for j in range(n)]
                        out = c.prefill(ids, logits=FULL)
                        np.testing.assert_allclose(out.logits.values[0], oracle(hf_tiny_llama, ids)[-1], atol=ATOL,
                                                   rtol=0)
                        c.release_cache(out.kv_cache)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=decoder, args=(i,)) for i in range(3)]
        threads += [threading.Thread(target=prompter, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        with ExecutorClient(server.target) as c:
            assert c.status().kv_blocks_used == 0


def test_a_prompt_whose_next_part_finds_the_pool_full_is_undone_whole(tiny_llama_dir):
    """The pool is reserved part by part: when other sequences take the room a
    prompt's next part needs, that part is refused and the prompt's earlier parts
    are undone; the other sequences keep what they have."""
    ex = TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=48, block_size=4,
                                                                       prefill_chunk=8, prefix_caching=False))
    before = snapshot(ex)
    prompt = ex.open_prefill(list(range(1, 41)), None, FULL)  # 40 tokens: 10 of the 12 blocks
    plan = prompt.next_part(8)
    prompt.part_done(plan, ex.run([plan])[0])
    other = ex.prefill(list(range(50, 66)), None, LogitsPolicy.argmax()).kv_cache  # 4 blocks: 2 left
    with pytest.raises(KvCapacityExhausted):
        for _ in range(4):
            plan = prompt.next_part(8)
            prompt.part_done(plan, ex.run([plan])[0])
    prompt.abandon()  # what the worker does when a part cannot be planned
    after = snapshot(ex)
    assert set(after["seqs"]) == {other.cache_id}  # the prompt's sequence is gone
    assert after["seqs"][other.cache_id][0] == 16 and after["used"] == before["used"] + 4
