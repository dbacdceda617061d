"""``wait_ready`` returns once the server serves the client's model, not once the
channel connects: through ``ferrum-rpc serve`` processes whose model is still loading
when it is called (the server starting up; a model LoadModel is loading), the first
call after it succeeds.  What waiting cannot change is raised at once."""

from __future__ import annotations

import asyncio
import threading

import pytest

from ferrum_rpc.client import AsyncExecutorClient, ExecutorClient, LogitsPolicy, ModelNotFound
from ferrum_rpc.harness import ServerProcess
from ferrum_rpc.types import ServerState
from tests.system.test_replicas import free_port

GREEDY = LogitsPolicy.argmax()
FLAGS = ("--kv-tokens", "1024", "--block-size", "4", "--threads", "1", "--grace", "10")


def test_wait_ready_waits_out_a_load_model(tiny_llama_dir, tiny_qwen3_dir):
    """LoadModel is loading "second" (its first progress message came back) when
    wait_ready is called for it: it returns once "second" serves."""
    with ServerProcess(f"first={tiny_llama_dir}", *FLAGS) as server:
        server.wait_serving(120)
        with ExecutorClient(server.target, timeout=120) as admin, \
                ExecutorClient(server.target, model="second", timeout=60) as second:
            started, stages, failed = threading.Event(), [], []

            def progress(stage, elapsed_s):
                stages.append(stage)
                started.set()

            def load():
                try:
                    admin.load_model("second", str(tiny_qwen3_dir), progress=progress)
                except Exception as exc:  # shown by the assertion below
                    failed.append(exc)
                    started.set()

            loader = threading.Thread(target=load)
            loader.start()
            assert started.wait(120) and not failed, failed
            second.wait_ready(120)
            listed = {m.name: m.state for m in admin.list_models()}
            assert listed["second"] == "serving", listed
            out = second.prefill([4, 5, 6], logits=GREEDY)  # the first call: no MODEL_LOADING
            assert out.kv_cache.model == "second"
            loader.join(120)
            assert not failed and stages == ["loading", "warming up", "serving"]

            with ExecutorClient(server.target, model="nowhere") as lost, pytest.raises(ModelNotFound):
                lost.wait_ready(120)  # raised at once: no load of it is coming


def test_wait_ready_waits_out_a_server_start_up(tiny_llama_dir, tiny_qwen3_dir):
    """Clients made before the process even listens: wait_ready (blocking, for the model
    loaded second; asyncio, for the default one) returns once each serves, and the
    first calls succeed."""
    port = free_port()
    target = f"127.0.0.1:{port}"
    answers: dict[str, object] = {}

    async def default_model():
        async with AsyncExecutorClient(target, timeout=60) as aex:
            await aex.wait_ready(180)
            answers["status"] = (await aex.status()).state
            answers["first"] = (await aex.prefill([1, 2, 3], logits=GREEDY)).kv_cache.model

    def run_async():
        try:
            asyncio.run(default_model())
        except Exception as exc:  # shown by the assertion below
            answers["error"] = exc

    with ExecutorClient(target, model="second", timeout=60) as second:
        waiting = threading.Thread(target=run_async)
        waiting.start()
        with ServerProcess(f"first={tiny_llama_dir}", "--model", f"second={tiny_qwen3_dir}", *FLAGS,
                           port=port):
            second.wait_ready(180)
            assert second.prefill([4, 5, 6], logits=GREEDY).kv_cache.model == "second"
            waiting.join(180)
            assert "error" not in answers, answers
            assert answers == {"status": ServerState.SERVING, "first": "first"}
