"""UpdateWeights through real gRPC on the tiny Llama: afterwards the logits equal a
fresh server's on the new weights bit for bit; a load running through the update sees
only whole versions; a corrupted, truncated or foreign update changes nothing; live
sequences go on or are dropped as the caller chose; only admin tenants may update."""

from __future__ import annotations

import shutil
import threading

import grpc
import numpy as np
import pytest
from safetensors.numpy import load_file, save

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, Reason
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import TENANT_TOKENS, running_server, tenants_server
from tests.waiting import wait_for

FULL = LogitsPolicy()
PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]


@pytest.fixture(scope="module")
def perturbed(tiny_llama_dir, tmp_path_factory):
    """The tiny model's checkpoint with every tensor moved a little, and a folder of it."""
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    rng = np.random.default_rng(7)
    tensors = {name: (t + rng.normal(0, 0.02, t.shape)).astype(t.dtype) for name, t in original.items()}
    folder = tmp_path_factory.mktemp("perturbed")
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    (folder / "model.safetensors").write_bytes(save(tensors))
    return tensors, folder


def logits(client, prompt=PROMPT) -> np.ndarray:
    out = client.prefill(prompt, logits=FULL)
    client.release_cache(out.kv_cache)
    return np.asarray(out.logits.values, dtype=np.float32)


@pytest.mark.parametrize("quantize", ["none", pytest.param("int8", marks=pytest.mark.cpu_only)])
def test_after_an_update_the_logits_equal_a_fresh_server_on_the_new_weights(tiny_llama_dir, perturbed, quantize):
    tensors, folder = perturbed
    with running_server(folder, quantize=quantize) as fresh, ExecutorClient(fresh.target) as c:
        want = logits(c)
    with running_server(tiny_llama_dir, quantize=quantize) as srv, ExecutorClient(srv.target) as c:
        before, kept = logits(c), c.prefill(PROMPT, logits=FULL).kv_cache
        reply = c.update_weights(tensors)
        assert (reply.weights_version, reply.tensors) == (1, len(tensors)) and reply.rebuild_s > 0
        assert 0 < reply.paused_s < reply.rebuild_s  # built beside the serving model: the pause is the swap
        after = logits(c)
        assert np.array_equal(after, want) and not np.array_equal(after, before)
        assert c.capabilities().weights_version == 1 and c.status().weights_version == 1
        step = c.decode(3, kept, FULL)  # kept (the default): it goes on, with the new weights
        assert step.kv_cache.weights_version == 1


@pytest.mark.cpu_only  # its fresh server is batch-invariant
def test_a_load_through_the_update_sees_only_whole_versions(tiny_llama_dir, perturbed):
    tensors, folder = perturbed
    prompts = [[5 + i, 17, 42, 99, 5, 230, 17 + i, 8] for i in range(16)]
    # batch-invariant: a row's logits are the same alone as in any batch, so each row
    # of the load equals exactly one version's row computed alone
    with running_server(folder, batch_invariant=True) as fresh, ExecutorClient(fresh.target) as c:
        new = [logits(c, p) for p in prompts]
    with running_server(tiny_llama_dir, batch_invariant=True) as srv, ExecutorClient(srv.target) as c:
        old = [logits(c, p) for p in prompts]
        seen, stop, errors = [], threading.Event(), []

        def generate(i):
            with ExecutorClient(srv.target) as mine:
                while not stop.is_set():
                    try:
                        seen.append((i, logits(mine, prompts[i])))
                    except Exception as exc:  # noqa: BLE001 - every failure is a test failure
                        errors.append(exc)
                        return

        threads = [threading.Thread(target=generate, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        def rows(n: int) -> None:
            wait_for(lambda: (len(seen), len(errors)), 60, f"{n} rows (rows, errors)",
                     until=lambda o: o[0] >= n or o[1] > 0)

        rows(32)
        c.update_weights(tensors)
        rows(len(seen) + 32)
        stop.set()
        for t in threads:
            t.join()
        assert not errors
        versions = [0 if np.array_equal(row, old[i]) else 1 if np.array_equal(row, new[i]) else None
                    for i, row in seen]
        assert None not in versions, "a forward mixed the two versions' weights"
        assert 0 in versions and 1 in versions


def test_invalidated_sequences_say_so(tiny_llama_dir, perturbed):
    tensors, _ = perturbed
    with running_server(tiny_llama_dir) as srv, ExecutorClient(srv.target) as c:
        handle = c.prefill(PROMPT, logits=FULL).kv_cache
        reply = c.update_weights(tensors, invalidate_sequences=True)
        assert reply.sequences_invalidated == 1 and c.status().active_sequences == 0
        with pytest.raises(ExecutorError) as dropped:
            c.decode(3, handle, FULL)
        assert dropped.value.reason is Reason.WEIGHTS_CHANGED
        assert dropped.value.code is grpc.StatusCode.FAILED_PRECONDITION


def test_the_prefix_cache_starts_afresh(tiny_llama_dir, perturbed):
    """No block cached before the update is a hit after it, and a KV-event watcher is
    resynced: a new hello names the new chain root, with an empty snapshot."""
    from ferrum_rpc.hashing import chain_root
    tensors, folder = perturbed
    prompt = list(range(30, 62))
    with running_server(tiny_llama_dir) as srv, ExecutorClient(srv.target) as c, \
            grpc.insecure_channel(srv.target) as channel:
        c.prefill(prompt, logits=FULL)  # kept: its blocks stay cached
        watch = pb_grpc.ModelExecutorStub(channel).WatchKvEvents(pb.WatchKvEventsRequest(snapshot=True), timeout=30)
        first = next(watch)
        assert first.hello.chain_root == chain_root("") and len(first.hello.cached) > 0
        c.update_weights(tensors)
        resync = next(b for b in watch if b.HasField("hello"))
        assert resync.resync and resync.hello.chain_root == chain_root("", "", 1) and not resync.hello.cached
        watch.cancel()
        out = c.prefill(prompt, logits=FULL)
        assert out.cached_tokens == 0
    with running_server(folder) as fresh, ExecutorClient(fresh.target) as f:
        assert np.array_equal(np.asarray(out.logits.values), np.asarray(f.prefill(prompt, logits=FULL).logits.values))


def raw_update(target: str, messages) -> grpc.RpcError:
    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as failed:
            pb_grpc.ModelExecutorStub(channel).UpdateWeights(iter(messages), timeout=30)
    return failed.value


@pytest.fixture(scope="module")
def cold_server(tiny_llama_dir):
    """No prefix cache: the same prompt gives the same bits every time it runs."""
    with running_server(tiny_llama_dir, prefix_caching=False) as srv:
        yield srv


@pytest.mark.parametrize("case", ["checksum", "truncated", "no_trailer", "name", "shape", "dtype", "not_safetensors",
                                  "too_big"])
def test_a_bad_update_changes_nothing(cold_server, perturbed, case):
    from ferrum_rpc.hashing import stream_hasher
    tensors, _ = perturbed
    name = "model.layers.0.mlp.up_proj.weight"
    body = {"name": {**tensors, "model.layers.9.nope.weight": tensors[name]},
            "shape": {name: tensors[name][:, :-1].copy()},
            "dtype": {name: tensors[name].astype(np.int32)}}.get(case, tensors)
    data = b"not a safetensors file at all" if case == "not_safetensors" else save(body)
    total = (1 << 40) if case == "too_big" else len(data)
    checksum = stream_hasher()
    checksum.update(data)
    digest = bytes(32) if case == "checksum" else checksum.digest()
    sent = data[: len(data) // 2] if case == "truncated" else data
    messages = [pb.WeightsChunk(header=pb.WeightsHeader(total_bytes=total)), pb.WeightsChunk(data=sent)]
    if case != "no_trailer":
        messages.append(pb.WeightsChunk(trailer=pb.WeightsTrailer(checksum=digest)))
    srv = cold_server
    with ExecutorClient(srv.target) as c:
        before, handle = logits(c), c.prefill(PROMPT, logits=FULL).kv_cache
        error = raw_update(srv.target, messages)
        want = {"checksum": grpc.StatusCode.DATA_LOSS, "no_trailer": grpc.StatusCode.DATA_LOSS}.get(
            case, grpc.StatusCode.INVALID_ARGUMENT)
        assert error.code() is want, error.details()
        if case in ("name", "shape", "dtype"):
            assert "tensor" in error.details()
        assert np.array_equal(logits(c), before) and c.status().weights_version == 0
        c.release_cache(c.decode(3, handle, FULL).kv_cache)  # its sequence untouched


def test_updates_are_for_admin_tenants(tiny_llama_dir, perturbed, tmp_path_factory):
    tensors, _ = perturbed
    with tenants_server(tiny_llama_dir, tmp_path_factory, admin_tenants=("alice",), prefix_caching=False) as srv:
        with ExecutorClient(srv.target, token=TENANT_TOKENS["bob"]) as bob:
            before = logits(bob)
            with pytest.raises(ExecutorError) as refused:
                bob.update_weights(tensors)
            assert refused.value.reason is Reason.ADMIN_ONLY
            assert np.array_equal(logits(bob), before)
        with ExecutorClient(srv.target, token=TENANT_TOKENS["alice"]) as alice:
            assert alice.update_weights(tensors).weights_version == 1
