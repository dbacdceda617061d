"""LoRA adapters through real gRPC on the tiny Llama: adapters made with peft, logits
against transformers + peft, a BatchPrefill and batched decodes mixing adapters and the
base, sequences that keep their adapter (decodes, forks, decoding ahead), prefix caches
that never cross adapters, and every refusal from the error table."""

from __future__ import annotations


import grpc
import numpy as np
import pytest

from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy, TokenChoice
from ferrum_rpc.errors import ExecutorError, Reason
from tests.conftest import TENANT_TOKENS, running_server, tenants_server
from tests.component.models.lora_helpers import edit_config, make_adapter, oracle
from tests.waiting import wait_for

PROMPTS = ([1, 17, 42, 99, 5, 230, 17, 8], [3, 4, 5, 6, 7, 8, 9, 10, 11], [200, 201, 9, 9, 9, 12])
FULL = LogitsPolicy()


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {"a": make_adapter(tiny_llama_dir, root / "a", seed=1, r=8),
            "b": make_adapter(tiny_llama_dir, root / "b", seed=2, r=16, alpha=8, use_rslora=True),
            "c": make_adapter(tiny_llama_dir, root / "c", seed=3, r=4, targets=["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def server(tiny_llama_dir, adapters):
    loras = tuple((name, str(path)) for name, path in adapters.items() if name != "c")
    with running_server(tiny_llama_dir, kv_tokens=4096, loras=loras, max_adapters=3) as srv:
        yield srv


@pytest.fixture
def client(server):
    with ExecutorClient(server.target) as c:
        yield c


def rows(out) -> np.ndarray:
    return np.asarray(out.logits.values, dtype=np.float32).reshape(-1, out.logits.vocab_size)


def test_prefill_and_decode_with_an_adapter_match_transformers_and_peft(client, tiny_llama_dir, adapters):
    for name in ("a", "b", ""):
        want = oracle(tiny_llama_dir, adapters[name] if name else None)
        ids = list(PROMPTS[0])
        out = client.prefill(ids, logits=FULL, adapter=name)
        assert out.kv_cache.adapter == name
        np.testing.assert_allclose(rows(out)[-1], want(ids)[-1].numpy(), atol=1e-4, rtol=0)
        handle = out.kv_cache
        for token in (7, 300, 12, 12, 5):
            ids.append(token)
            step = client.decode(token, handle, FULL)
            np.testing.assert_allclose(rows(step)[-1], want(ids)[-1].numpy(), atol=1e-4, rtol=0)
            handle = step.kv_cache
        assert handle.adapter == name
        client.release_cache(handle)


def test_a_batch_mixing_adapters_and_the_base_gives_each_sequence_what_it_gets_alone(client):
    names = ["a", "", "b", "a"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    alone = []
    for name, prompt in zip(names, prompts):
        out = client.prefill(prompt, logits=FULL, adapter=name)
        step = client.decode(9, out.kv_cache, FULL)
        alone.append((rows(out)[-1], rows(step)[-1]))
        client.release_cache(step.kv_cache)
    outs = client.batch_prefill(prompts, FULL, adapters=names)
    steps = client.batch_decode([DecodeInput(9, o.kv_cache) for o in outs], FULL)
    for (first, second), out, step in zip(alone, outs, steps):
        np.testing.assert_allclose(rows(out)[-1], first, atol=1e-5, rtol=0)
        np.testing.assert_allclose(rows(step)[-1], second, atol=1e-5, rtol=0)
        client.release_cache(step.kv_cache)
    assert [o.kv_cache.adapter for o in outs] == names


def test_forks_and_decoding_ahead_keep_the_adapter(client, tiny_llama_dir, adapters):
    greedy = TokenChoice(temperature=0.0)
    out = client.prefill(PROMPTS[2], token_choice=greedy, adapter="b")
    child = client.fork_cache(out.kv_cache, 1)[0]
    assert child.adapter == "b"
    run = client.decode_ahead(out.chosen.token_id, child, greedy, 6)
    want = oracle(tiny_llama_dir, adapters["b"])
    ids = list(PROMPTS[2]) + [out.chosen.token_id]
    for token in run.chosen:  # greedy under the adapter, step by step, from the oracle
        assert token.token_id == int(want(ids)[-1].argmax())
        ids.append(token.token_id)
    assert run.kv_cache.adapter == "b"
    client.release_cache(run.kv_cache)
    client.release_cache(out.kv_cache)


def test_the_prefix_cache_never_crosses_adapters(client):
    prompt = list(range(30, 62))  # several whole blocks
    first = client.prefill(prompt, logits=FULL, adapter="a")
    again = client.prefill(prompt, logits=FULL, adapter="a")
    assert again.cached_tokens > 0
    for name in ("", "b"):
        other = client.prefill(prompt, logits=FULL, adapter=name)
        assert other.cached_tokens == 0, f"adapter {name!r} was served adapter a's cached KV"
        client.release_cache(other.kv_cache)
    for out in (first, again):
        client.release_cache(out.kv_cache)


def test_load_list_unload_at_run_time(client, adapters, tmp_path):
    entry = client.load_adapter("c", str(adapters["c"]))
    assert (entry.rank, list(entry.target_modules), entry.sequences) == (4, ["q_proj", "v_proj", "down_proj"], 0)
    assert entry.bytes > 0 and len(entry.digest) == 64
    listed = {e.name: e for e in client.list_adapters()}
    assert set(listed) == {"a", "b", "c"}
    out = client.prefill(PROMPTS[0], logits=FULL, adapter="c")
    assert {e.name: e.sequences for e in client.list_adapters()}["c"] == 1
    with pytest.raises(ExecutorError) as busy:
        client.unload_adapter("c")
    assert busy.value.reason is Reason.ADAPTER_IN_USE and busy.value.code is grpc.StatusCode.FAILED_PRECONDITION
    client.release_cache(out.kv_cache)
    client.unload_adapter("c")
    assert {e.name for e in client.list_adapters()} == {"a", "b"}
    status, caps = client.status(), client.capabilities()
    assert status.adapters_loaded == 2 and status.adapter_bytes > 0
    assert (caps.max_adapters, caps.max_lora_rank) == (3, 64)


@pytest.mark.parametrize("case", ["unknown", "continue", "not_lora", "dora", "rank", "missing_module",
                                  "other_model", "traversal", "name"])
def test_refusals_name_the_field_and_change_nothing(client, adapters, tmp_path, case):
    before = [(e.name, e.digest) for e in client.list_adapters()]
    sequences = client.status().active_sequences
    if case == "unknown":
        call, reason = (lambda: client.prefill(PROMPTS[0], adapter="nope")), Reason.ADAPTER_NOT_FOUND
        field = "nope"
    elif case == "continue":
        out = client.prefill(PROMPTS[0], logits=FULL, adapter="a")
        sequences += 1
        call, reason, field = (lambda: client.prefill([5], out.kv_cache, adapter="b")), Reason.ADAPTER_INVALID, "adapter"
    else:
        folder = {
            "not_lora": lambda: edit_config(adapters["a"], tmp_path / "x", peft_type="IA3"),
            "dora": lambda: edit_config(adapters["a"], tmp_path / "x", use_dora=True),
            "rank": lambda: make_adapter(client_dir(client), tmp_path / "x", seed=4, r=128),
            "missing_module": lambda: edit_config(adapters["a"], tmp_path / "x", target_modules=["q_proj", "w9"]),
            "other_model": lambda: make_adapter(other_llama(tmp_path / "other"), tmp_path / "x", seed=5, r=4),
            "traversal": lambda: tmp_path / ".." / ".." / ".." / "etc",
            "name": lambda: adapters["a"],
        }[case]()
        name = "bad name/.." if case == "name" else "x"
        call, reason = (lambda: client.load_adapter(name, str(folder))), Reason.ADAPTER_INVALID
        field = {"not_lora": "peft_type", "dora": "use_dora", "rank": "r", "missing_module": "target_modules",
                 "other_model": "shape", "traversal": "path", "name": "name"}[case]
    with pytest.raises(ExecutorError) as refused:
        call()
    assert refused.value.reason is reason, refused.value
    assert field in str(refused.value)
    assert [(e.name, e.digest) for e in client.list_adapters()] == before
    assert client.status().active_sequences == sequences


def other_llama(path):
    """A tiny Llama of another shape (a wider MLP): an adapter for it fits no tiny_llama module."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.conftest import _save_tiny
    return _save_tiny(path, LlamaConfig, LlamaForCausalLM, seed=6, intermediate_size=96)


def client_dir(client) -> str:
    """The model folder the server loaded (for adapters of its architecture)."""
    return client.list_models()[0].path


def test_changes_are_for_admin_tenants(tiny_llama_dir, adapters, tmp_path_factory):
    with tenants_server(tiny_llama_dir, tmp_path_factory, admin_tenants=("alice",)) as srv:
        with ExecutorClient(srv.target, token=TENANT_TOKENS["bob"]) as bob:
            with pytest.raises(ExecutorError) as refused:
                bob.load_adapter("a", str(adapters["a"]))
            assert refused.value.reason is Reason.ADMIN_ONLY
            assert bob.list_adapters() == []
        with ExecutorClient(srv.target, token=TENANT_TOKENS["alice"]) as alice:
            alice.load_adapter("a", str(adapters["a"]))
            assert [e.name for e in alice.list_adapters()] == ["a"]


def test_an_export_moves_with_its_adapter_and_a_mismatch_is_refused(client, tiny_llama_dir, adapters):
    out = client.prefill(PROMPTS[0], logits=FULL, adapter="a")
    blob = client.export_sequence(out.kv_cache)
    with running_server(tiny_llama_dir, kv_tokens=1024, loras=(("b", str(adapters["b"])),)) as other:
        with ExecutorClient(other.target) as there:
            with pytest.raises(ExecutorError) as refused:
                there.import_sequence(blob)  # no adapter "a" there
            assert refused.value.reason is Reason.FINGERPRINT_MISMATCH and "adapter" in str(refused.value)
            there.load_adapter("a", str(adapters["b"]))  # a name, but other weights
            with pytest.raises(ExecutorError) as refused:
                there.import_sequence(blob)
            assert refused.value.reason is Reason.FINGERPRINT_MISMATCH and "digest" in str(refused.value)
            assert there.status().active_sequences == 0
            there.load_adapter("a", str(adapters["a"]), replace=True)
            moved = there.import_sequence(blob)
            assert moved.adapter == "a"
            np.testing.assert_allclose(rows(there.decode(7, moved, FULL))[-1],
                                       rows(client.decode(7, out.kv_cache, FULL))[-1], atol=1e-5, rtol=0)


def test_a_replica_set_places_by_adapter_and_replays_it_after_a_sigkill(tiny_llama_dir, adapters):
    """Two ``ferrum-rpc serve`` replicas, adapter "a" only on the second at first: a new
    sequence running "a" lands there (the first answers ADAPTER_NOT_FOUND and is passed
    over).  With "a" on both, the owner is SIGKILLed mid-generation: the sequence is
    replayed on the survivor under the same adapter, and every step equals the oracle's."""
    from ferrum_rpc.client.replicas import ReplicaSetClient
    from ferrum_rpc.harness import all_serving
    from tests.system.test_replicas import Replica

    lora = ("--lora", f"a={adapters['a']}")
    with all_serving(Replica(tiny_llama_dir), Replica(tiny_llama_dir, *lora)) as (bare, holder):
        with ReplicaSetClient([bare.target, holder.target], timeout=30) as fleet:
            want = oracle(tiny_llama_dir, adapters["a"])
            ids = list(PROMPTS[1])
            out = fleet.prefill(ids, logits=FULL, adapter="a")
            assert fleet.replica_of(out.kv_cache) == holder.target and out.kv_cache.adapter == "a"
            with ExecutorClient(bare.target) as one:
                one.load_adapter("a", str(adapters["a"]))
            handle = out.kv_cache
            for n, token in enumerate((3, 8, 13, 21)):
                if n == 2:
                    owner = {bare.target: bare, holder.target: holder}[fleet.replica_of(handle)]
                    owner.kill()
                ids.append(token)
                step = fleet.decode(token, handle, FULL)
                np.testing.assert_allclose(rows(step)[-1], want(ids)[-1].numpy(), atol=1e-4, rtol=0)
                handle = step.kv_cache
            assert handle.adapter == "a" and fleet.replica_of(handle) == bare.target


def test_a_load_whose_deadline_passes_while_queued_loads_nothing(server, adapters):
    """The worker is held; a LoadAdapter with a short deadline waits behind it and
    expires: once the worker is free the load never runs."""
    import threading

    worker = server.app.servicer.gate.workers["tiny"]
    gate = threading.Event()
    held = worker.submit(gate.wait, 30)
    wait_for(held.running, 30, "the worker to run the holding job")
    try:
        with ExecutorClient(server.target, timeout=0.3) as impatient:
            with pytest.raises(ExecutorError) as expired:
                impatient.load_adapter("late", str(adapters["c"]))
            assert expired.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(lambda: server.app.servicer.gate.inflight, 10, "the server's side of the call to end too",
                 until=lambda n: n == 0)
    finally:
        gate.set()
    with ExecutorClient(server.target) as c:
        assert "late" not in {e.name for e in c.list_adapters()}


def test_kv_events_name_adapter_roots_and_route_adapter_prompts_to_their_cache(tiny_llama_dir, adapters):
    """Replica X caches 4 system prompts of 24 tokens under adapter "a".  Its KV-event
    hello names "a"'s chain root, so a replica set's router sees those blocks as "a"'s
    (and not the base model's): each follow-up running "a" goes to X and hits 24 cached
    tokens.  Loading another adapter resyncs the streams, and the new hello names it."""
    from ferrum_rpc import hashing
    from ferrum_rpc.client.replicas import ReplicaPolicy, ReplicaSetClient
    from ferrum_rpc.harness import all_serving
    from tests.system.test_replicas import Replica

    lora = ("--lora", f"a={adapters['a']}", "--max-adapters", "3")
    with all_serving(Replica(tiny_llama_dir, *lora), Replica(tiny_llama_dir, *lora)) as (x, y):
        systems = [[(11 * i + 5 * j) % 290 + 3 for j in range(24)] for i in range(4)]
        with ExecutorClient(x.target, timeout=30) as direct:
            kept = [direct.prefill(s + [5, 6, 7], adapter="a").kv_cache for s in systems]
            (entry,) = direct.list_adapters()
        with ReplicaSetClient([x.target, y.target], timeout=30,
                              replica_policy=ReplicaPolicy(status_ttl_s=0.05, seed=0)) as fleet:
            router = fleet.routing._router
            wait_for(lambda: [router.matched_tokens(s, "a").get(x.target, 0) for s in systems], 20,
                     "the events (24 tokens matched on X per system prompt)", until=lambda m: min(m) >= 24)
            index = router.indexes[x.target]
            assert index.adapter_roots == {"a": hashing.chain_root("", entry.digest)}
            assert all(router.matched_tokens(s).get(x.target) == 0 for s in systems)  # not the base's blocks
            assert all(router.matched_tokens(s, "b").get(x.target) == 0 for s in systems)  # an adapter X lacks
            outs = [fleet.prefill(s + [9, 10, 11, i], adapter="a") for i, s in enumerate(systems)]
            assert [o.cached_tokens for o in outs] == [24] * 4
            assert {fleet.replica_of(o.kv_cache) for o in outs} == {x.target}
            for o in outs:
                fleet.release_cache(o.kv_cache)
            with ExecutorClient(x.target, timeout=30) as direct:
                direct.load_adapter("c", str(adapters["c"]))
                digest = next(e.digest for e in direct.list_adapters() if e.name == "c")
            wait_for(lambda: set(index.adapter_roots), 20, "a new hello naming c after the load",
                     until=lambda roots: "c" in roots)
            assert index.adapter_roots["c"] == hashing.chain_root("", digest)
        with ExecutorClient(x.target, timeout=30) as direct:
            for handle in kept:
                direct.release_cache(handle)
