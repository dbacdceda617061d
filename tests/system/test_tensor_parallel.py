"""Tensor parallelism: real ``serve --tensor-parallel N`` processes whose
ranks are real processes joined by torch.distributed (gloo), driven through real
gRPC; every row equals transformers on the same weights (float32, 1e-4) and the
unsplit executor.  A rank that dies or hangs fails the server closed.

One degree-2 server per architecture serves every parity test (started together,
once per module): the split's cost here is start-up, not forwards."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, Reason
from ferrum_rpc.harness import ServerProcess, all_serving
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.rules import pack_allowed_tokens, unpack_allowed_tokens
from ferrum_rpc.types import DecodeInput, HiddenStatesRequest, LogprobsMode, TokenChoice
from tests.conftest import oracle_rows
from tests.waiting import wait_for

ATOL = 1e-4
FULL = LogitsPolicy.full()
ALL = LogitsPolicy.full(all_positions=True)
ARCHS = ["llama", "qwen3", "qwen3_moe"]
PROMPT = [5, 17, 101, 3, 250, 42, 7, 9, 300, 11, 64, 2, 77]
TIMEOUT_S = 4.0  # --tensor-parallel-timeout: a forward waiting this long for a rank fails the server
FLAGS = ("--tensor-parallel", "2", "--kv-tokens", "1024", "--block-size", "4", "--prefill-chunk", "8",
         "--no-warmup", "--tensor-parallel-timeout", str(TIMEOUT_S), "--metrics-port", "0")


@pytest.fixture(scope="module")
def folders(tiny_llama_dir, tiny_qwen3_dir, tiny_moe_dir):
    return {"llama": tiny_llama_dir, "qwen3": tiny_qwen3_dir, "qwen3_moe": tiny_moe_dir}


@pytest.fixture(scope="module")
def servers(folders):
    """Degree-2 servers: Llama on the probed fast paths, Qwen3 and Qwen3-MoE on the fallbacks."""
    procs = {arch: ServerProcess(f"tiny={folder}", *FLAGS, *(() if arch == "llama" else
                                                             ("--linear-kernel", "aten", "--step-ops", "eager")))
             for arch, folder in folders.items()}
    with all_serving(*procs.values(), timeout=180):
        yield procs


@pytest.fixture(scope="module")
def oracles(folders):
    from transformers import AutoModelForCausalLM

    return {arch: AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
            for arch, folder in folders.items()}


def _client(servers, arch: str) -> ExecutorClient:
    return ExecutorClient(servers[arch].target, timeout=60)


def _children(server: ServerProcess) -> list[psutil.Process]:
    return psutil.Process(server.pid).children(recursive=True)


def _rank_processes(server: ServerProcess) -> list[psutil.Process]:
    """The rank processes (multiprocessing's spawned children; not its resource tracker)."""
    return [p for p in _children(server) if "spawn_main" in " ".join(p.cmdline())]


def _alive(procs: list[psutil.Process]) -> list[int]:
    return [p.pid for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_capabilities_report_the_split_and_every_rank_is_a_process(servers):
    for server in servers.values():
        with _client(servers, "llama") as ex:
            caps = ex.capabilities()
        assert caps.tensor_parallel and caps.tensor_parallel_degree == 2
        assert any("token choice" in f for f in caps.tensor_parallel_fallbacks)
        assert len(_rank_processes(server)) == 1
    log = servers["llama"].log()
    assert "rank 1 of 2 joined (gloo" in log and "in rank 1's shard of 2" in log


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_16_greedy_steps_equal_transformers(servers, oracles, arch):
    """FULL rows gathered over the vocabulary shards, and ARGMAX reduced from each
    rank's best: both equal transformers at every step."""
    hf = oracles[arch]
    with _client(servers, arch) as ex:
        out = ex.prefill(PROMPT, logits=ALL)
        np.testing.assert_allclose(out.logits.values, oracle_rows(hf, PROMPT), atol=ATOL, rtol=0)
        ids, handle = list(PROMPT), out.kv_cache
        token = int(out.logits.values[-1].argmax())
        for i in range(16):
            ids.append(token)
            step = ex.decode(token, handle, FULL if i % 2 else LogitsPolicy.argmax())
            ref = oracle_rows(hf, ids)[-1]
            if i % 2:
                np.testing.assert_allclose(step.logits.values[0], ref, atol=ATOL, rtol=0)
            else:
                assert step.logits.token_ids[0, 0] == ref.argmax()
                np.testing.assert_allclose(step.logits.values[0, 0], ref.max(), atol=ATOL, rtol=0)
            handle, token = step.kv_cache, int(ref.argmax())
        ex.release_cache(handle)


@torch.no_grad()
def test_a_bfloat16_kv_pool_on_every_rank_matches_transformers_with_its_cache_rounded(folders, oracles):
    """--kv-dtype bfloat16 split over 2 ranks: each rank's pool holds its KV heads in
    bfloat16, keys and values rounded once as written; prompt and greedy steps equal
    transformers with a cache that rounds the same way."""
    hf = oracles["llama"]
    with all_serving(ServerProcess(f"tiny={folders['llama']}", *FLAGS, "--kv-dtype", "bfloat16"), timeout=180) \
            as (server,), ExecutorClient(server.target, timeout=60) as ex:
        assert ex.info().kv_dtype == "bfloat16" and ex.capabilities().tensor_parallel
        out = ex.prefill(PROMPT, logits=ALL)
        np.testing.assert_allclose(out.logits.values, oracle_rows(hf, PROMPT, torch.bfloat16), atol=ATOL, rtol=0)
        ids, handle, token = list(PROMPT), out.kv_cache, int(out.logits.values[-1].argmax())
        for _ in range(8):
            ids.append(token)
            step = ex.decode(token, handle, FULL)
            ref = oracle_rows(hf, ids, torch.bfloat16)[-1]
            np.testing.assert_allclose(step.logits.values[0], ref, atol=ATOL, rtol=0)
            handle, token = step.kv_cache, int(ref.argmax())
        ex.release_cache(handle)


def test_an_int8_kv_pool_split_by_kv_head_matches_one_rank(folders):
    """--kv-dtype int8 split over 2 ranks: each rank's pool holds its KV heads' int8 rows
    and their scales (a row's scale is its own head's, so the split changes none); the
    prompt's and 8 greedy steps' logits agree with one process's int8 pool (to the
    all-reduce's order), the same tokens chosen."""
    from tests.conftest import running_server

    with all_serving(ServerProcess(f"tiny={folders['llama']}", *FLAGS, "--kv-dtype", "int8"), timeout=180) \
            as (server,), running_server(folders["llama"], kv_dtype="int8") as one, \
            ExecutorClient(server.target, timeout=60) as ex, ExecutorClient(one.target, timeout=60) as ref:
        assert ex.info().kv_dtype == "int8" and ex.capabilities().tensor_parallel
        split, whole = ex.capabilities(), ref.capabilities()  # a rank's block holds half the heads' rows
        assert split.kv_bytes * 2 * (whole.kv_num_blocks + 1) == whole.kv_bytes * (split.kv_num_blocks + 1)
        got, want = ex.prefill(PROMPT, logits=ALL), ref.prefill(PROMPT, logits=ALL)
        np.testing.assert_allclose(got.logits.values, want.logits.values, atol=ATOL, rtol=0)
        token = int(want.logits.values[-1].argmax())
        for _ in range(8):
            got, want = ex.decode(token, got.kv_cache, FULL), ref.decode(token, want.kv_cache, FULL)
            np.testing.assert_allclose(got.logits.values[0], want.logits.values[0], atol=ATOL, rtol=0)
            assert int(got.logits.values[0].argmax()) == int(want.logits.values[0].argmax())
            token = int(want.logits.values[0].argmax())


def test_top_k_is_reduced_across_vocabulary_shards(servers, oracles):
    """TOP_K over ranks' own top-k: the global top-k, sorted, values and ids."""
    with _client(servers, "llama") as ex:
        out = ex.prefill(PROMPT, logits=LogitsPolicy.topk(20, all_positions=True))
        ref = torch.from_numpy(oracle_rows(oracles["llama"], PROMPT)).topk(20, dim=-1)
        np.testing.assert_array_equal(out.logits.token_ids, ref.indices.numpy())
        np.testing.assert_allclose(out.logits.values, ref.values.numpy(), atol=ATOL, rtol=0)
        ex.release_cache(out.kv_cache)


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_of_mixed_lengths_equals_transformers(servers, oracles, arch):
    prompts = [[1, 2, 3], list(range(10, 31)), [7], list(range(40, 52)), [300, 200, 100, 5, 6]]
    with _client(servers, arch) as ex:
        handles = [ex.prefill(p, logits=LogitsPolicy.argmax()).kv_cache for p in prompts]
        outs = ex.batch_decode([(11 * (i + 1), h) for i, h in enumerate(handles)], FULL)
        for i, (out, prompt) in enumerate(zip(outs, prompts)):
            assert out.timing.batch_size == len(prompts)
            np.testing.assert_allclose(out.logits.values[0], oracle_rows(oracles[arch], prompt + [11 * (i + 1)])[-1],
                                       atol=ATOL, rtol=0)
            ex.release_cache(out.kv_cache)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_prompt_parts_share_forwards_with_decodes_and_equal_transformers(servers, oracles, arch):
    """The unified forward, ragged, with chunked prompts (8-token parts) beside
    decodes of other callers; each row equals transformers on its own sequence."""
    hf, errors = oracles[arch], []

    def decoder(i: int) -> None:
        try:
            with _client(servers, arch) as c:
                ids = [7 + i, 8 + i, 9 + i]
                out = c.prefill(ids, logits=FULL)
                handle, token = out.kv_cache, int(out.logits.values[0].argmax())
                for _ in range(8):
                    ids.append(token)
                    step = c.decode(token, handle, FULL)
                    np.testing.assert_allclose(step.logits.values[0], oracle_rows(hf, ids)[-1], atol=ATOL, rtol=0)
                    handle, token = step.kv_cache, int(step.logits.values[0].argmax())
                c.release_cache(handle)
        except BaseException as exc:
            errors.append(exc)

    def prompter() -> None:
        try:
            with _client(servers, arch) as c:
                ids = [(11 * j) % 300 + 1 for j in range(45)]
                out = c.prefill(ids, logits=ALL)
                np.testing.assert_allclose(out.logits.values, oracle_rows(hf, ids), atol=ATOL, rtol=0)
                c.release_cache(out.kv_cache)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(2)] + [threading.Thread(target=prompter)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]


def test_chunked_prefill_verify_truncate_and_speculative_decode(servers, oracles):
    hf = oracles["llama"]
    with _client(servers, "llama") as ex:
        first = ex.prefill(PROMPT[:5], logits=LogitsPolicy.argmax())
        cont = ex.prefill(PROMPT[5:], first.kv_cache, logits=FULL)  # a caller's chunk after a chunk
        np.testing.assert_allclose(cont.logits.values[0], oracle_rows(hf, PROMPT)[-1], atol=ATOL, rtol=0)
        drafts = [3, 250, 42]
        verify = ex.forward_verify(drafts, cont.kv_cache, FULL)
        np.testing.assert_allclose(verify.logits.values, oracle_rows(hf, PROMPT + drafts)[-3:], atol=ATOL, rtol=0)
        back = ex.truncate_kv(verify.kv_cache, len(PROMPT))
        again = ex.decode(9, back, FULL)
        np.testing.assert_allclose(again.logits.values[0], oracle_rows(hf, PROMPT + [9])[-1], atol=ATOL, rtol=0)
        greedy = [int(oracle_rows(hf, PROMPT + [9])[-1].argmax())]
        greedy.append(int(oracle_rows(hf, PROMPT + [9] + greedy)[-1].argmax()))
        spec = ex.speculative_decode(greedy[0], [greedy[1], 299], again.kv_cache, FULL)
        assert spec.accepted_token_ids == (greedy[1],)  # the greedy draft kept, the wrong one dropped
        np.testing.assert_allclose(spec.logits.values[0], oracle_rows(hf, PROMPT + [9] + greedy)[-1], atol=ATOL,
                                   rtol=0)
        assert spec.kv_cache.sequence_length == len(PROMPT) + 3
        ex.release_cache(spec.kv_cache)
        assert ex.status().kv_blocks_used == 0


def test_forks_and_prefix_hits_equal_transformers(servers, oracles):
    """Fork children share the parent's blocks on every rank (copied on write, the copy
    sent to every rank); a prompt sharing full blocks reads them from the cache."""
    hf = oracles["llama"]
    with _client(servers, "llama") as ex:
        parent = ex.prefill(PROMPT, logits=LogitsPolicy.argmax()).kv_cache  # 13 tokens: block 3 part-full
        children = ex.fork_cache(parent, 2)
        for child, token in zip(children, (4, 5)):
            step = ex.decode(token, child, FULL)
            np.testing.assert_allclose(step.logits.values[0], oracle_rows(hf, PROMPT + [token])[-1], atol=ATOL,
                                       rtol=0)
            ex.release_cache(step.kv_cache)
        hit = ex.prefill(PROMPT[:12] + [8, 8], logits=FULL)
        assert hit.cached_tokens == 12
        np.testing.assert_allclose(hit.logits.values[0], oracle_rows(hf, PROMPT[:12] + [8, 8])[-1], atol=ATOL, rtol=0)
        ex.release_cache(hit.kv_cache)
        ex.release_cache(parent)


def test_hidden_states_and_attention_weights_of_every_head(servers, oracles):
    """Attention weights are computed per rank for its heads and gathered in head order."""
    hf = oracles["qwen3"]
    layers, heads = hf.config.num_hidden_layers, hf.config.num_attention_heads
    with torch.no_grad():
        hf.set_attn_implementation("eager")
        ref = hf(torch.tensor([PROMPT]), output_hidden_states=True, output_attentions=True)
        hf.set_attn_implementation("sdpa")
    with _client(servers, "qwen3") as ex:
        ask = HiddenStatesRequest(layers=tuple(range(layers + 1)), attention_layers=tuple(range(layers)))
        out = ex.prefill(PROMPT, logits=LogitsPolicy.argmax(), hidden_states=ask)
        for got, want in zip(out.hidden_states, ref.hidden_states):
            np.testing.assert_allclose(got, want[0].numpy(), atol=ATOL, rtol=0)
        for got, want in zip(out.attention_weights, ref.attentions):
            assert got.shape == (heads, len(PROMPT), len(PROMPT))
            np.testing.assert_allclose(got, want[0].numpy(), atol=ATOL, rtol=0)
        ex.release_cache(out.kv_cache)


@pytest.fixture(scope="module")
def unsplit(folders):
    """The degree-1 reference: the same tiny Llama in this process."""
    return TorchExecutor.from_path("tiny", folders["llama"], ExecutorConfig(kv_tokens=512, block_size=4))


def test_token_choice_equals_the_unsplit_executor(servers, unsplit):
    """Seeded sampling with penalties on degree 2 chooses what degree 1 chooses."""
    choice = TokenChoice(temperature=0.8, top_p=0.9, seed=7, repetition_penalty=1.2, top_logprobs=3)
    out = unsplit.prefill(PROMPT, policy=None, choice=choice)
    expected, handle = [out.chosen.token_id], out.kv_cache
    for _ in range(8):
        step = unsplit.decode(expected[-1], handle, policy=None, choice=choice)
        expected.append(step.chosen.token_id)
        handle = step.kv_cache
    unsplit.release_cache(handle.cache_id)
    with _client(servers, "llama") as ex:
        out = ex.prefill(PROMPT, token_choice=choice)
        got, handle = [out.chosen.token_id], out.kv_cache
        for _ in range(8):
            step = ex.decode(got[-1], handle, token_choice=choice)
            got.append(step.chosen.token_id)
            handle = step.kv_cache
        ex.release_cache(handle)
    assert got == expected


# -- token choice across vocabulary slices (tp_choice): no whole rows gathered -------------------
VOCAB = 320  # conftest's tiny models; rank 1's slice is 160 tokens, 640 bytes of float32 a row
STEPS = 8


def _metric(server: ServerProcess, name: str) -> float:
    """A counter of the server's Prometheus exposition (its port read from the log)."""
    import urllib.request

    port = re.search(r"metrics on http://[\d.]+:(\d+)/metrics", server.log()).group(1)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return sum(float(m) for m in re.findall(rf"^{name}_total{{[^}}]*}} (\S+)$", text, re.M))


def _choose_in_batch(prefill, batch_decode, choices, prompts) -> list[list]:
    """Each prompt prefilled with its choice, then STEPS batched decodes of all of them:
    every row's chosen tokens (ChosenToken: id, logprob, top logprobs)."""
    outs = [prefill(p, c) for p, c in zip(prompts, choices)]
    chosen, handles = [[o.chosen] for o in outs], [o.kv_cache for o in outs]
    for _ in range(STEPS):
        outs = batch_decode([DecodeInput(c[-1].token_id, h, choice) for c, h, choice in zip(chosen, handles, choices)])
        for c, o in zip(chosen, outs):
            c.append(o.chosen)
        handles = [o.kv_cache for o in outs]
    return chosen, handles


def _degree_1(unsplit, choices, prompts):
    chosen, handles = _choose_in_batch(lambda p, c: unsplit.prefill(p, policy=None, choice=c),
                                       lambda items: unsplit.batch_decode(items, policy=None), choices, prompts)
    for h in handles:
        unsplit.release_cache(h.cache_id)
    return chosen


def _degree_2(ex, choices, prompts):
    chosen, handles = _choose_in_batch(lambda p, c: ex.prefill(p, token_choice=c),
                                       lambda items: ex.batch_decode(items), choices, prompts)
    for h in handles:
        ex.release_cache(h)
    return chosen


def _assert_same_choices(got, want):
    """Same tokens; logprobs and top logprobs (ids and values) within 1e-5."""
    for row_got, row_want in zip(got, want):
        assert [c.token_id for c in row_got] == [c.token_id for c in row_want]
        for a, b in zip(row_got, row_want):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
            assert [t.token_id for t in a.top_logprobs] == [t.token_id for t in b.top_logprobs]
            np.testing.assert_allclose([t.logprob for t in a.top_logprobs], [t.logprob for t in b.top_logprobs],
                                       atol=1e-5, rtol=0)


def test_greedy_with_penalties_bias_and_grammar_mask_equals_degree_1_without_gathering_rows(servers, unsplit):
    """Bias, penalties and the allowed-token mask run on each rank's slice, the argmax
    and logsumexp reduce across ranks: degree 1's tokens and logprobs, and one forward
    gathers fewer bytes than one row's slice (RAW and PROCESSED logprobs)."""
    mask = pack_allowed_tokens([t for t in range(VOCAB) if t % 3 and t not in (17, 250)], VOCAB)
    choices = [
        TokenChoice.greedy(repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4,
                           logit_bias={3: 2.0, 200: 1.5, 301: -100.0}, top_logprobs=3),
        TokenChoice.greedy(allowed_token_bitmask=mask, top_logprobs=2, logprobs_mode=LogprobsMode.PROCESSED),
        TokenChoice.greedy(allowed_token_bitmask=mask, repetition_penalty=1.3, logit_bias={1: 3.0}),
    ]
    prompts = [PROMPT, PROMPT[:5], [250, 17, 4]]
    want = _degree_1(unsplit, choices, prompts)
    with _client(servers, "llama") as ex:
        _assert_same_choices(_degree_2(ex, choices, prompts), want)
        allowed = set(unpack_allowed_tokens(mask, VOCAB).nonzero()[0].tolist())
        assert all(c.token_id in allowed for row in want[1:] for c in row)
        # one forward, one greedy row with 3 logprobs: its statistics and candidates, not its row
        out = ex.prefill(PROMPT, token_choice=choices[0])
        server = servers["llama"]
        forwards, sent = _metric(server, "ferrum_tensor_parallel_forwards"), \
            _metric(server, "ferrum_tensor_parallel_lm_head_bytes")
        step = ex.decode(out.chosen.token_id, out.kv_cache, token_choice=choices[0])
        assert _metric(server, "ferrum_tensor_parallel_forwards") == forwards + 1
        gathered = _metric(server, "ferrum_tensor_parallel_lm_head_bytes") - sent
        assert 0 < gathered < 4 * VOCAB // 2  # 48 statistics + 8 * (3 candidates + 3 raw) + 24 = 120
        ex.release_cache(step.kv_cache)


def test_seeded_top_k_top_p_min_p_and_temperature_draw_degree_1s_tokens(servers, unsplit):
    """The draw is degree 1's inverse CDF split by per-rank masses, candidates merged
    across ranks: the same (seed, position) draws the same token as degree 1, with its
    logprobs within 1e-5.  On these 320 tokens top-k 40 and top-p's 256 candidates
    would cost more than a 160-token slice, so those rows gather whole rows, counted
    in GetCapabilities (tests/system/test_tp_choice.py has them on candidates at 8k)."""
    choices = [
        TokenChoice(temperature=0.9, top_k=20, seed=11, top_logprobs=3),
        TokenChoice(temperature=1.1, top_p=0.8, seed=12, top_logprobs=2, logprobs_mode=LogprobsMode.PROCESSED),
        TokenChoice(temperature=0.8, min_p=0.1, seed=13, top_logprobs=3, logprobs_mode=LogprobsMode.PROCESSED),
        TokenChoice(temperature=1.0, seed=14, presence_penalty=0.5, top_logprobs=1),
        TokenChoice(temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, seed=15, frequency_penalty=0.3),
        TokenChoice(temperature=5.0, top_p=0.99, seed=16, top_logprobs=2),  # the nucleus: most of the vocabulary
    ]
    prompts = [PROMPT, PROMPT[3:], [9, 8, 7], [1], PROMPT[:4], [42, 43]]
    want = _degree_1(unsplit, choices, prompts)

    def fallbacks(ex) -> int:
        text = next(f for f in ex.capabilities().tensor_parallel_fallbacks if f.startswith("token choice"))
        return int(re.search(r"\((\d+) rows so far\)", text).group(1))

    with _client(servers, "llama") as ex:
        before = fallbacks(ex)
        _assert_same_choices(_degree_2(ex, choices, prompts), want)
        assert fallbacks(ex) > before
    assert len({c.token_id for row in want for c in row}) > 20  # sampled, not one greedy path


def test_decoding_ahead_on_a_split_server_equals_degree_1(servers, unsplit):
    """DecodeSession's max_new_tokens: the server chooses and appends on its own, each
    choice reduced across the ranks."""
    choice = TokenChoice(temperature=0.9, top_k=30, seed=21, repetition_penalty=1.1)
    out = unsplit.prefill(PROMPT, policy=None, choice=choice)
    want, handle = [out.chosen.token_id], out.kv_cache
    for _ in range(12):
        step = unsplit.decode(want[-1], handle, policy=None, choice=choice)
        want.append(step.chosen.token_id)
        handle = step.kv_cache
    unsplit.release_cache(handle.cache_id)
    with _client(servers, "llama") as ex:
        out = ex.prefill(PROMPT, token_choice=choice)
        run = ex.decode_ahead(out.chosen.token_id, out.kv_cache, choice, 12)
        assert run.finish_reason == "length"
        assert [out.chosen.token_id] + [c.token_id for c in run.chosen] == want
        assert run.kv_cache.sequence_length == len(PROMPT) + 12
        ex.release_cache(run.kv_cache)


def test_load_and_unload_model_are_refused_and_the_model_keeps_serving(servers, folders):
    """The ranks hold the one model they started with: UNIMPLEMENTED, nothing changes."""
    with _client(servers, "llama") as ex:
        for call in (lambda: ex.load_model("other", str(folders["qwen3"])), lambda: ex.unload_model("tiny")):
            with pytest.raises(ExecutorError) as err:
                call()
            assert err.value.code.name == "UNIMPLEMENTED" and "--tensor-parallel" in str(err.value)
        before = ex.status().active_sequences
        handle = ex.prefill([1, 2, 3], logits=LogitsPolicy.argmax()).kv_cache
        assert ex.status().active_sequences == before + 1
        ex.release_cache(handle)


def test_exports_and_imports_are_refused_on_a_split_server(servers):
    """Rank 0 holds only its KV heads, so a sequence cannot leave or arrive whole (yet):
    UNIMPLEMENTED, said by Capabilities.accepts_imports, and the sequence is untouched."""
    with _client(servers, "llama") as ex:
        assert not ex.capabilities().accepts_imports
        out = ex.prefill([1, 2, 3, 4, 5], logits=LogitsPolicy.argmax())
        for call in (lambda: ex.export_sequence(out.kv_cache), lambda: ex.create_import_ticket()):
            with pytest.raises(ExecutorError) as err:
                call()
            assert err.value.code.name == "UNIMPLEMENTED" and "--tensor-parallel" in str(err.value)
        step = ex.decode(int(out.logits.argmax()[0]), out.kv_cache, logits=LogitsPolicy.argmax())
        assert step.kv_cache.sequence_length == 6
        ex.release_cache(step.kv_cache)


def test_ranks_started_apart_join_at_a_rendezvous_address(tiny_llama_dir, oracles):
    """As across machines: each rank its own ``serve`` (rank 1 not a child of rank 0),
    joined at --tp-master; rank 0 serves gRPC, rank 1 exits 0 when rank 0 stops."""
    from ferrum_rpc.server.parallel.group import free_port

    master = f"127.0.0.1:{free_port()}"
    flags = ["--kv-tokens", "256", "--block-size", "4", "--no-warmup", "--linear-kernel", "aten",
             "--step-ops", "eager", "--tensor-parallel", "2", "--tp-master", master]
    rank1 = subprocess.Popen([sys.executable, "-m", "ferrum_rpc.cli", "serve", "--model", f"tiny={tiny_llama_dir}",
                              *flags, "--tp-rank", "1"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    try:
        with ServerProcess(f"tiny={tiny_llama_dir}", *flags, "--tp-rank", "0") as server:
            server.wait_serving(120)
            assert not _rank_processes(server)
            with ExecutorClient(server.target, timeout=60) as ex:
                out = ex.prefill(PROMPT, logits=ALL)
                np.testing.assert_allclose(out.logits.values, oracle_rows(oracles["llama"], PROMPT), atol=ATOL,
                                           rtol=0)
            assert server.stop() == 0
        assert rank1.wait(30) == 0
        assert "rank 1: stopping" in rank1.stderr.read()
    finally:
        rank1.kill()


def test_head_counts_the_degree_does_not_divide_are_refused_at_start(tiny_llama_dir):
    """4 heads and 2 KV heads do not split 3 ways: one line, exit code 2, no rank started."""
    proc = subprocess.run([sys.executable, "-m", "ferrum_rpc.cli", "serve", "--model", str(tiny_llama_dir),
                           "--tensor-parallel", "3", "--port", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--tensor-parallel 3 does not divide" in lines[0], proc.stderr


def _decode_until_failure(target: str, started: threading.Event, result: dict) -> None:
    try:
        with ExecutorClient(target, timeout=30) as ex:
            handle = ex.prefill(PROMPT, logits=LogitsPolicy.argmax()).kv_cache
            started.set()
            while True:
                handle = ex.decode(1, handle, LogitsPolicy.argmax()).kv_cache
                result["steps"] = result.get("steps", 0) + 1
                if handle.sequence_length > 200:
                    handle = ex.truncate_kv(handle, len(PROMPT))
    except ExecutorError as exc:
        result["error"] = exc
        result["at"] = time.monotonic()


# -- last in the module: these end the servers they test --------------------------------------
@pytest.mark.parametrize("arch, how", [("qwen3", "killed"), ("qwen3_moe", "hung")])
def test_a_lost_rank_fails_the_server_closed(servers, arch, how):
    """A rank killed mid-decode (or stopped: it hangs) ends serving within a bound:
    the caller's call fails UNAVAILABLE with TENSOR_PARALLEL_RANK_LOST (or finds the
    server gone), the server exits 3, and no rank process outlives it."""
    server = servers[arch]
    ranks, children = _rank_processes(server), _children(server)
    assert len(ranks) == 1
    started, result = threading.Event(), {}
    caller = threading.Thread(target=_decode_until_failure, args=(server.target, started, result), daemon=True)
    caller.start()
    assert started.wait(30)
    wait_for(lambda: result.get("steps", 0), 30, "the caller's third decode", until=lambda n: n >= 3)  # decoding
    lost_at = time.monotonic()
    os.kill(ranks[0].pid, signal.SIGKILL if how == "killed" else signal.SIGSTOP)
    bound = 2.0 + (TIMEOUT_S if how == "hung" else 0.0)
    assert server.proc.wait(bound + 5) == 3
    exited_at = time.monotonic()
    caller.join(10)
    error = result["error"]
    assert error.code.name == "UNAVAILABLE"
    if how == "hung":  # the worker is stuck in a collective: the call is failed for it, with the reason
        assert error.reason is Reason.TENSOR_PARALLEL_RANK_LOST, error
    else:  # the collective errs at once: the reason, or (racing the exit) the server gone
        assert error.reason is Reason.TENSOR_PARALLEL_RANK_LOST or \
            re.search(r"connect|Socket closed|unavailable", str(error), re.I), error
    assert result["at"] - lost_at < bound and exited_at - lost_at < bound + 1.5, \
        (result["at"] - lost_at, exited_at - lost_at)
    assert "tensor parallelism lost" in server.log()
    # the ranks (and multiprocessing's helper) went with the server
    wait_for(lambda: _alive(children), 5, "no rank process left (pids alive)", until=lambda pids: not pids)


@pytest.mark.slow
def test_smollm2_at_degree_3_gives_degree_1s_16_greedy_tokens():
    """The real SmolLM2-135M (9 heads, 3 KV heads) split 3 ways; and 8 seeded draws at
    temperature 0.8 over its whole 49,152-token vocabulary (the per-rank-mass inverse
    CDF over three 16,384-token slices), decoded ahead, are degree 1's."""
    from ferrum_rpc.server.prepare import prepare_default_model

    folder = prepare_default_model()
    prompt = [1, 504, 3458, 282, 253, 3575, 282, 4649, 47]
    kernels = dict(linear_kernel="aten", step_ops="eager")  # no load-time probes: 3 ranks share 2 cores here
    one = TorchExecutor.from_path("smol", folder, ExecutorConfig(kv_tokens=256, block_size=16, **kernels))
    out = one.prefill(prompt, policy=LogitsPolicy.argmax())
    expected, handle = [int(out.logits.token_ids[0, 0])], out.kv_cache
    for _ in range(15):
        step = one.decode(expected[-1], handle, LogitsPolicy.argmax())
        expected.append(int(step.logits.token_ids[0, 0]))
        handle = step.kv_cache
    choice = TokenChoice(temperature=0.8, seed=5)
    out = one.prefill(prompt, policy=None, choice=choice)
    drawn, handle = [out.chosen.token_id], out.kv_cache
    for _ in range(8):
        step = one.decode(drawn[-1], handle, policy=None, choice=choice)
        drawn.append(step.chosen.token_id)
        handle = step.kv_cache
    with ServerProcess(f"smol={folder}", "--tensor-parallel", "3", "--kv-tokens", "256", "--no-warmup",
                       "--linear-kernel", "aten", "--step-ops", "eager") as server:
        server.wait_serving(300)
        with ExecutorClient(server.target, timeout=60) as ex:
            out = ex.prefill(prompt, logits=LogitsPolicy.argmax())
            got, handle = [int(out.logits.token_ids[0, 0])], out.kv_cache
            for _ in range(15):
                step = ex.decode(got[-1], handle, LogitsPolicy.argmax())
                got.append(int(step.logits.token_ids[0, 0]))
                handle = step.kv_cache
            out = ex.prefill(prompt, token_choice=choice)
            run = ex.decode_ahead(out.chosen.token_id, out.kv_cache, choice, 8)
    assert got == expected
    assert [out.chosen.token_id] + [c.token_id for c in run.chosen] == drawn
