"""The model registry through a real server: load a second model while the first
keeps serving, use it, unload it (its handles then say so), load it again; admin
only when tokens are on; failed loads leave nothing behind."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ferrum_rpc.client import AsyncExecutorClient, ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import AdminOnly, CacheNotFound, InvalidInput, ModelNotFound
from tests.conftest import running_server

GREEDY = LogitsPolicy.argmax()


def test_load_use_unload_and_reload_while_the_first_model_serves(tiny_llama_dir, tiny_qwen3_dir):
    with running_server(tiny_llama_dir, name="first") as server, \
            ExecutorClient(server.target, timeout=60) as ex, \
            ExecutorClient(server.target, model="second", timeout=60) as second:
        # the first model decodes the whole time the second one loads
        steps, stop = [0], threading.Event()
        head = ex.prefill([1, 2, 3], logits=GREEDY)

        def keep_decoding():
            handle = head.kv_cache
            while not stop.is_set():
                handle = ex.decode(1, handle, GREEDY).kv_cache
                steps[0] += 1
            ex.release_cache(handle)

        decoder = threading.Thread(target=keep_decoding)
        decoder.start()
        stages = []
        ex.load_model("second", str(tiny_qwen3_dir), progress=lambda stage, s: stages.append(stage))
        stop.set()
        decoder.join()
        assert stages == ["loading", "warming up", "serving"] and steps[0] > 0
        listed = {m.name: m for m in ex.list_models()}
        assert listed["first"].is_default and listed["second"].state == "serving"
        assert listed["second"].path == str(tiny_qwen3_dir) and listed["second"].status.model == "second"
        assert second.info().architecture == "qwen3"

        seq = second.prefill([4, 5, 6], logits=GREEDY)
        assert ex.unload_model("second") == 1
        with pytest.raises(ModelNotFound, match="was unloaded"):
            second.decode(1, seq.kv_cache, GREEDY)
        assert [m.name for m in ex.list_models()] == ["first"]
        assert ex.prefill([7, 8], logits=GREEDY).kv_cache.model == "first"  # the first never stopped

        ex.load_model("second", str(tiny_qwen3_dir))
        again = second.prefill([4, 5, 6], logits=GREEDY)
        assert again.logits.argmax() == seq.logits.argmax()  # the same weights, served afresh
        with pytest.raises(CacheNotFound):  # the old handle stays dead: the new instance never had it
            second.decode(1, seq.kv_cache, GREEDY)


def test_the_asyncio_client_loads_lists_and_unloads(tiny_llama_dir, tiny_qwen3_dir):
    """The same registry calls awaited (they come from the table the blocking client uses)."""
    async def run():
        async with AsyncExecutorClient(server.target, timeout=60) as aex, \
                AsyncExecutorClient(server.target, model="second", timeout=60) as second:
            await aex.wait_ready(10)
            stages = []
            await aex.load_model("second", str(tiny_qwen3_dir), progress=lambda stage, s: stages.append(stage))
            assert stages == ["loading", "warming up", "serving"]
            assert [m.name for m in await aex.list_models()] == ["first", "second"]
            await second.prefill([4, 5, 6], logits=GREEDY)
            assert await aex.unload_model("second") == 1
            assert [m.name for m in await aex.list_models()] == ["first"]
            with pytest.raises(ModelNotFound):
                await aex.unload_model("second")

    with running_server(tiny_llama_dir, name="first") as server:
        asyncio.run(run())


def test_bad_loads_leave_nothing_behind(tiny_llama_dir, tmp_path):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{}")
    with running_server(tiny_llama_dir, name="first") as server, ExecutorClient(server.target, timeout=60) as ex:
        for name, path, why in [("x", str(tmp_path / "nothing"), "no model folder"),
                                ("first", str(tiny_llama_dir), "hosted already"),
                                ("", str(tiny_llama_dir), "name must be"),
                                ("x", str(tmp_path / "broken"), "cannot load")]:
            with pytest.raises(InvalidInput, match=why):
                ex.load_model(name, path)
        with pytest.raises(ModelNotFound):
            ex.unload_model("never-there")
        assert [m.name for m in ex.list_models()] == ["first"]


def test_registry_changes_are_admin_only_with_tokens(tiny_llama_dir, tiny_qwen3_dir, tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("alice alice-token-aaaaaaaaaaaaaaaaaaaa\nbob bob-token-bbbbbbbbbbbbbbbbbbbbbbb\n")
    kwargs = {"auth_tokens": str(tokens), "admin_tenants": ("alice",)}
    with running_server(tiny_llama_dir, name="first", server_kwargs=kwargs) as server, \
            ExecutorClient(server.target, timeout=60, token="alice-token-aaaaaaaaaaaaaaaaaaaa") as alice, \
            ExecutorClient(server.target, timeout=60, token="bob-token-bbbbbbbbbbbbbbbbbbbbbbb") as bob:
        with pytest.raises(AdminOnly):
            bob.load_model("second", str(tiny_qwen3_dir))
        assert [m.name for m in bob.list_models()] == ["first"]  # listing is for everyone
        alice.load_model("second", str(tiny_qwen3_dir))
        with pytest.raises(AdminOnly):
            bob.unload_model("second")
        assert alice.unload_model("second") == 0
