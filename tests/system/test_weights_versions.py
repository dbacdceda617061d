"""Weights versions through real gRPC on the tiny Llama: KV that tokens of older weights
fed is never a prefix-cache hit under newer ones, whichever path the sequence took
across the UpdateWeights (decode, truncate, fork, export and import), and updates
apply on top of what serves (two partial updates give the weights of both).

The oracle is a fresh server started on the new weights' files: a prompt after the
update must get its logits bit for bit (the server is batch-invariant, so a cold
prefill there equals a cold prefill here)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, Reason
from tests.conftest import running_server

pytestmark = pytest.mark.timeout(300)

FULL = LogitsPolicy()
BLOCK = 16  # one block of the servers here: a sequence's first block completes at token 16
FIRST = [1, 17, 42, 99, 5, 230, 17, 8, 64, 3]  # 10 tokens, computed before the update
AFTER = [11, 12, 13, 14, 15, 16, 18, 19]  # 8 more, decoded after it: the first block completes
MORE = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]  # the tail of the later prompt


def checkpoint_folder(tiny_llama_dir, tmp_path_factory, tensors: dict, label: str):
    """A model folder: the tiny model's files with ``tensors`` in place of its own."""
    folder = tmp_path_factory.mktemp(label)
    for f in tiny_llama_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    (folder / "model.safetensors").write_bytes(save(tensors))
    return folder


@pytest.fixture(scope="module")
def original(tiny_llama_dir):
    return load_file(str(tiny_llama_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def perturbed(tiny_llama_dir, tmp_path_factory, original):
    """Every tensor moved a little, and a folder of the result (the update's oracle)."""
    rng = np.random.default_rng(11)
    tensors = {name: (t + rng.normal(0, 0.05, t.shape)).astype(t.dtype) for name, t in original.items()}
    return tensors, checkpoint_folder(tiny_llama_dir, tmp_path_factory, tensors, "perturbed")


def server(folder):
    return running_server(folder, block_size=BLOCK, batch_invariant=True)


def cold_logits(target: str, prompt: list[int]) -> np.ndarray:
    """The prompt's last-position logits on a server with an empty prefix cache for it."""
    with ExecutorClient(target) as c:
        out = c.prefill(prompt, logits=FULL)
        c.release_cache(out.kv_cache)
        return np.asarray(out.logits.values, dtype=np.float32)


def decode_all(c: ExecutorClient, handle, tokens: list[int]):
    for token in tokens:
        handle = c.decode(token, handle, FULL).kv_cache
    return handle


def assert_no_stale_hit(c: ExecutorClient, target_new: str, prompt: list[int]) -> None:
    """A later prompt over the sequence's tokens is computed afresh, so its logits
    equal a fresh server's on the new weights."""
    out = c.prefill(prompt, logits=FULL)
    assert out.cached_tokens == 0, "a block fed by old-weights KV was a prefix-cache hit"
    want = cold_logits(target_new, prompt)
    assert np.array_equal(np.asarray(out.logits.values, dtype=np.float32), want)
    c.release_cache(out.kv_cache)


@pytest.fixture(scope="module")
def fresh_new(perturbed):
    with server(perturbed[1]) as fresh:
        yield fresh.target


@pytest.mark.parametrize("path", ["decode", "truncate", "fork"])
def test_a_block_completed_after_an_update_is_never_a_hit(tiny_llama_dir, perturbed, fresh_new, path):
    tensors, _ = perturbed
    with server(tiny_llama_dir) as srv, ExecutorClient(srv.target) as c:
        if path == "truncate":  # a whole first block before the update, cut back into it after
            handle = c.prefill(FIRST + AFTER + [40, 41], logits=FULL).kv_cache
        else:
            handle = c.prefill(FIRST, logits=FULL).kv_cache
        c.update_weights(tensors)  # the sequence is kept (the default)
        if path == "truncate":
            handle = c.truncate_kv(handle, len(FIRST))
        elif path == "fork":
            handle = c.fork_cache(handle, 1)[0]
        handle = decode_all(c, handle, AFTER)
        assert handle.sequence_length == len(FIRST + AFTER) > BLOCK
        assert_no_stale_hit(c, fresh_new, FIRST + AFTER + MORE)


def test_a_sequence_begun_after_the_update_is_a_hit(tiny_llama_dir, perturbed, fresh_new):
    """The other side: the prefix cache still serves what the new weights computed."""
    tensors, _ = perturbed
    with server(tiny_llama_dir) as srv, ExecutorClient(srv.target) as c:
        c.update_weights(tensors)
        decode_all(c, c.prefill(FIRST, logits=FULL).kv_cache, AFTER)
        out = c.prefill(FIRST + AFTER + MORE, logits=FULL)
        assert out.cached_tokens == BLOCK
        assert np.array_equal(np.asarray(out.logits.values, dtype=np.float32),
                              cold_logits(fresh_new, FIRST + AFTER + MORE))


def test_an_export_names_the_weights_its_kv_was_computed_with(tiny_llama_dir, perturbed, fresh_new):
    """A sequence kept across an update exports with the old weights' digest, so the
    updated server does not take it back (nor does a fresh one on the new weights);
    one begun after the update does go back in."""
    tensors, _ = perturbed
    with server(tiny_llama_dir) as srv, ExecutorClient(srv.target) as c, ExecutorClient(fresh_new) as f:
        kept = decode_all(c, c.prefill(FIRST, logits=FULL).kv_cache, AFTER[:2])
        c.update_weights(tensors)
        kept = decode_all(c, kept, AFTER[2:])
        data = c.export_sequence(kept)
        for target in (c, f):
            with pytest.raises(ExecutorError) as refused:
                target.import_sequence(data)
            assert refused.value.reason is Reason.FINGERPRINT_MISMATCH
        assert f.status().active_sequences == 0
        new = c.prefill(FIRST + AFTER, logits=FULL).kv_cache
        moved = c.import_sequence(c.export_sequence(new))
        assert moved.sequence_length == len(FIRST + AFTER)


def scaled(original: dict, name: str, by: float) -> dict:
    return {name: (original[name] * by).astype(original[name].dtype)}


def test_partial_updates_accumulate(tiny_llama_dir, tmp_path_factory, original):
    """Update 1 changes one tensor, update 2 another: the server then serves both, bit
    for bit what a fresh server on a checkpoint with both changes serves."""
    names = sorted(n for n in original if n.endswith("mlp.down_proj.weight") or n.endswith("mlp.up_proj.weight"))
    first, second = scaled(original, names[-1], 1.5), scaled(original, names[0], 0.5)
    both = checkpoint_folder(tiny_llama_dir, tmp_path_factory, {**original, **first, **second}, "both")
    only_second = checkpoint_folder(tiny_llama_dir, tmp_path_factory, {**original, **second}, "second")
    prompt = FIRST + AFTER
    with server(both) as want_both, server(only_second) as want_second:
        want, second_alone = cold_logits(want_both.target, prompt), cold_logits(want_second.target, prompt)
    assert not np.array_equal(want, second_alone)
    with server(tiny_llama_dir) as srv, ExecutorClient(srv.target) as c:
        assert c.update_weights(first).weights_version == 1
        assert c.update_weights(second).weights_version == 2
        assert np.array_equal(cold_logits(srv.target, prompt), want)
        # a full update after partial ones replaces them all
        assert c.update_weights(dict(original)).weights_version == 3
        with server(tiny_llama_dir) as base:
            assert np.array_equal(cold_logits(srv.target, prompt), cold_logits(base.target, prompt))
