"""Server lifecycle: health while loading, serving, draining; SIGTERM on a real process.

The in-process tests drive ``build_server`` / ``App.load`` / ``App.drain`` on
their own event loop and hold the model worker with a gate, so "in flight" is
exact.  The subprocess test runs ``python -m ferrum_rpc.cli serve`` and sends
it a real SIGTERM while calls from several threads are queued on its worker.
"""

from __future__ import annotations

import asyncio
import re
import signal
import threading
import time
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from ferrum_rpc.client import ExecutorClient, ExecutorError, LogitsPolicy
from ferrum_rpc.harness import ServerProcess
from ferrum_rpc.server.app import build_server
from ferrum_rpc.server.config import ExecutorConfig, ModelSpec, ServerConfig
from ferrum_rpc.types import ServerState
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.waiting import wait_for, wait_for_async

SERVICE = "ferrum.executor.v1.ModelExecutor"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROMPT = [1, 2, 3, 4, 5]
ARGMAX = pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX)


def reason_of(err: grpc.RpcError) -> str | None:
    """The ``google.rpc.ErrorInfo`` reason a status carries, read straight off the wire."""
    status = rpc_status.from_call(err)
    for detail in status.details if status else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            return info.reason
    return None


def config_for(model_dir, **server) -> ServerConfig:
    return ServerConfig(models=(ModelSpec("tiny", str(model_dir)),), port=0,
                        executor=ExecutorConfig(kv_tokens=256, block_size=4), **server)


class Channel:
    """An asyncio channel with the executor and health stubs."""

    def __init__(self, port: int):
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.executor = pb_grpc.ModelExecutorStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def health_status(self, service: str = SERVICE) -> int:
        reply = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return reply.status

    async def refused(self, call) -> grpc.aio.AioRpcError:
        """Awaits a call that must fail; returns the error."""
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        return info.value

    async def close(self) -> None:
        await self.channel.close()


async def _stop(app) -> None:
    """Cleanup after a failed test: stop the server and any worker threads."""
    await app.server.stop(None)
    for worker in app.servicer.gate.workers.values():
        worker.stop(timeout=5)


async def _assert_down_or_not_serving(ch: Channel) -> None:
    try:
        status = await ch.health_status()
    except grpc.aio.AioRpcError as err:
        assert err.code() is grpc.StatusCode.UNAVAILABLE, err
    else:
        assert status == NOT_SERVING


# -- in process: build_server / load / drain ------------------------------------------


def test_health_not_serving_while_loading_then_serving(tiny_llama_dir):
    async def scenario():
        app = await build_server(config_for(tiny_llama_dir))
        ch = Channel(app.port)
        try:
            assert app.port > 0
            # bound and answering, but no model yet
            watch = ch.health.Watch(health_pb2.HealthCheckRequest(service=SERVICE))
            assert (await watch.read()).status == NOT_SERVING
            assert await ch.health_status(SERVICE) == NOT_SERVING
            assert await ch.health_status("") == NOT_SERVING

            status = await ch.executor.GetStatus(pb.GetStatusRequest(), timeout=5)
            assert status.state == pb.Status.STATE_LOADING
            assert status.server_instance_id == app.servicer.gate.instance_id

            for call in (ch.executor.Prefill(pb.PrefillRequest(token_ids=PROMPT, logits=ARGMAX), timeout=5),
                         ch.executor.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)):
                err = await ch.refused(call)
                assert err.code() is grpc.StatusCode.UNAVAILABLE
                assert reason_of(err) == "MODEL_LOADING"

            await app.load()

            # the watcher sees the flip without polling
            assert (await asyncio.wait_for(watch.read(), 5)).status == SERVING
            watch.cancel()
            assert await ch.health_status(SERVICE) == SERVING
            assert await ch.health_status("") == SERVING
            status = await ch.executor.GetStatus(pb.GetStatusRequest(), timeout=5)
            assert status.state == pb.Status.STATE_SERVING
            assert status.model == "tiny"
            assert status.active_sequences == 0  # the warm-up released its cache
            reply = await ch.executor.Prefill(pb.PrefillRequest(token_ids=PROMPT, logits=ARGMAX), timeout=5)
            assert reply.kv_cache.sequence_length == len(PROMPT)
            assert reply.kv_cache.server_instance_id == app.servicer.gate.instance_id

            await app.drain(5)
            await _assert_down_or_not_serving(ch)
        except BaseException:
            await _stop(app)
            raise
        finally:
            await ch.close()

    asyncio.run(scenario())


def test_drain_finishes_in_flight_calls_and_refuses_new_ones(tiny_llama_dir):
    """The worker is held by a gate, so two calls are provably admitted and unanswered at drain."""

    async def scenario():
        app = await build_server(config_for(tiny_llama_dir))
        ch = Channel(app.port)
        gate = threading.Event()
        try:
            await app.load()
            warm = await ch.executor.Prefill(pb.PrefillRequest(token_ids=PROMPT, logits=ARGMAX), timeout=5)

            worker = app.servicer.gate.workers["tiny"]
            held = worker.submit(gate.wait, 10)  # the worker thread now waits on the gate
            prefill = asyncio.ensure_future(ch.executor.Prefill(
                pb.PrefillRequest(token_ids=PROMPT, logits=ARGMAX), timeout=15))
            stream = ch.executor.BatchDecode(pb.BatchDecodeRequest(
                items=[pb.DecodeItem(token_id=warm.logits.token_ids[0], kv_cache=warm.kv_cache)],
                logits=ARGMAX), timeout=15)
            batch = asyncio.ensure_future(_collect(stream))
            await wait_for_async(lambda: app.servicer.gate.inflight, 5, "both calls in flight", until=lambda n: n == 2)

            drain = asyncio.ensure_future(app.drain(10))
            calls_done_at_drain_end: list = []  # checked once all ends: drain ended after both calls
            drain.add_done_callback(lambda _: calls_done_at_drain_end.append((prefill.done(), batch.done())))
            await wait_for_async(lambda: app.servicer.gate.state, 5, "the server to drain",
                                 until=lambda s: s is ServerState.DRAINING)
            # health says NOT_SERVING as the drain's last step before it waits for the calls in flight
            await wait_for_async(lambda: ch.health_status(SERVICE), 5, "health NOT_SERVING",
                                 until=lambda s: s == NOT_SERVING)
            assert not drain.done(), "drain returned with calls still in flight"
            assert not prefill.done() and not batch.done()

            # still up, but saying it is going away
            assert await ch.health_status("") == NOT_SERVING
            # new work is refused at the door ...
            for call in (ch.executor.Prefill(pb.PrefillRequest(token_ids=PROMPT, logits=ARGMAX), timeout=5),
                         ch.executor.Decode(pb.DecodeRequest(token_id=1, kv_cache=warm.kv_cache), timeout=5),
                         _collect(ch.executor.BatchDecode(pb.BatchDecodeRequest(
                             items=[pb.DecodeItem(token_id=1, kv_cache=warm.kv_cache)]), timeout=5)),
                         ch.executor.ReleaseCache(pb.ReleaseCacheRequest(cache_id=warm.kv_cache.cache_id),
                                                  timeout=5)):
                err = await ch.refused(call)
                assert err.code() is grpc.StatusCode.UNAVAILABLE
                assert reason_of(err) == "DRAINING"
            assert app.servicer.gate.inflight == 2  # refusals are never counted as in flight
            # ... while queries still answer, so callers can see the state
            info = await ch.executor.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
            assert info.name == "tiny"
            status = asyncio.ensure_future(ch.executor.GetStatus(pb.GetStatusRequest(), timeout=15))

            gate.set()
            reply = await asyncio.wait_for(prefill, 10)
            assert reply.kv_cache.sequence_length == len(PROMPT)
            assert reply.logits.kind == pb.LOGITS_KIND_ARGMAX and len(reply.logits.token_ids) == 1
            (step,) = await asyncio.wait_for(batch, 10)
            assert step.kv_cache.cache_id == warm.kv_cache.cache_id
            assert step.kv_cache.sequence_length == len(PROMPT) + 1
            assert held.result(timeout=1) is True
            assert (await asyncio.wait_for(status, 10)).state == pb.Status.STATE_DRAINING

            await asyncio.wait_for(drain, 10)
            assert calls_done_at_drain_end == [(True, True)], "drain returned before the calls in flight ended"
            assert app.servicer.gate.inflight == 0
            await _assert_down_or_not_serving(ch)
        except BaseException:
            gate.set()
            await _stop(app)
            raise
        finally:
            await ch.close()

    asyncio.run(scenario())


async def _collect(stream) -> list:
    return [reply async for reply in stream]


# -- a real process: SIGTERM ------------------------------------------------------------


DRAINING = re.compile(r"draining: (\d+) call\(s\) in flight")


@dataclass
class CallRecord:
    name: str
    sent: float = 0.0
    done: float = 0.0
    result: object = None
    error: BaseException | None = None


def start_call(name: str, fn, *args) -> tuple[CallRecord, threading.Thread]:
    """Runs one blocking client call on its own thread, recording when it went out and came back."""
    rec = CallRecord(name)

    def run():
        rec.sent = time.monotonic()
        try:
            rec.result = fn(*args)
        except BaseException as exc:  # checked by the test
            rec.error = exc
        rec.done = time.monotonic()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return rec, thread


BATCH_WAIT_S = 1.0  # the worker holds a decode batch open this long for more decodes to join


def test_sigterm_drains_in_flight_calls_and_exits_zero(tiny_llama_dir):
    """SIGTERM while a batch of calls from several threads is provably admitted and unanswered.

    With ``--batch-wait-ms`` the model worker keeps a decode batch open for
    BATCH_WAIT_S while decodes of other sequences join it, so Decode and
    BatchDecode calls sent from several threads all sit on the server for about
    a second.  The signal goes out well after they were sent and well before
    the batch can have run.
    """
    server = ServerProcess(f"tiny={tiny_llama_dir}", "--kv-tokens", "256", "--block-size", "4", "--grace", "10",
                           "--batch-wait-ms", str(int(BATCH_WAIT_S * 1000)))
    calls: list[tuple[CallRecord, threading.Thread]] = []
    clients: list[ExecutorClient] = []
    health_channel = None
    try:
        server.wait_serving(timeout=60)
        instance, target = server.instance, server.target

        def client() -> ExecutorClient:
            c = ExecutorClient(target, timeout=30)
            clients.append(c)
            c.wait_ready(10)
            return c

        setup, late = client(), client()  # connected before the signal
        assert setup.status().server_instance_id == instance
        seqs = [setup.prefill([1 + i, 2, 3, 4, 5], logits=LogitsPolicy.argmax()).kv_cache for i in range(6)]
        health_channel = grpc.insecure_channel(target)
        health = health_pb2_grpc.HealthStub(health_channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == SERVING

        # four threads decode one sequence each, a fifth decodes two in one BatchDecode; their
        # clients are ready first (wait_ready asks GetStatus, which the held batch would delay)
        topk = LogitsPolicy.topk(3)
        callers = [client() for _ in range(5)]
        for i in range(4):
            calls.append(start_call(f"decode-{i}", callers[i].decode, 10 + i, seqs[i], topk))
            wait_for(lambda: calls[-1][0].sent, 10, f"decode-{i} to be sent")  # sent in order
        calls.append(start_call("batch-decode", callers[4].batch_decode, [(20, seqs[4]), (21, seqs[5])], topk))
        wait_for(lambda: calls[-1][0].sent, 10, "batch-decode to be sent")
        # The server shows no count of admitted calls a test can read without ending the held
        # batch (GetStatus queues a job, which closes it), so the signal goes out 0.3 s into the
        # 1 s batch window; the DRAINING line's count below checks every call had arrived.
        time.sleep(0.3)  # unobservable: no server figure says a call was admitted (see above)
        killed = time.monotonic()
        assert all(rec.sent and not rec.done for rec, _ in calls), \
            "precondition: the worker's batch wait should hold every decode past SIGTERM"
        server.proc.send_signal(signal.SIGTERM)

        # the server counts all of them as in flight ...
        in_flight = int(server.wait_for(DRAINING, timeout=10).group(1))
        assert in_flight == len(calls), server.log()

        # ... and, while it waits for them, refuses anything new
        with pytest.raises(ExecutorError) as refused:
            late.prefill(PROMPT, logits=LogitsPolicy.argmax())
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE, refused.value
        assert refused.value.reason is not None and refused.value.reason.value == "DRAINING", refused.value
        check = health.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        assert check.status == NOT_SERVING
        still_draining = time.monotonic()

        for rec, thread in calls:
            thread.join(timeout=15)
            assert not thread.is_alive(), f"{rec.name} never came back"
        code = server.proc.wait(timeout=15)
        exited = time.monotonic()
    finally:
        for c in clients:
            c.close()
        if health_channel is not None:
            health_channel.close()
        server.kill()

    log = server.log()
    assert code == 0, log
    assert "stopped" in log and "grace period over" not in log, log
    assert still_draining < min(rec.done for rec, _ in calls), "the refusal came after the calls finished"
    assert exited - killed < 10, "drain took longer than the work it waited for"

    # every call that was in flight at SIGTERM got a full, proper reply, from one forward
    outputs = []
    for i, (rec, _) in enumerate(calls):
        assert rec.error is None, f"{rec.name}: {rec.error!r}"
        assert rec.sent < killed < rec.done
        outputs += rec.result if isinstance(rec.result, list) else [rec.result]
    assert [o.kv_cache.cache_id for o in outputs] == [h.cache_id for h in seqs]
    for out in outputs:
        assert out.kv_cache.sequence_length == 6
        assert out.kv_cache.server_instance_id == instance
        assert np.asarray(out.logits.token_ids).shape == (1, 3)
        assert np.isfinite(np.asarray(out.logits.values)).all()
        assert out.timing.batch_size == len(seqs)

    # once it is gone, a call is plain UNAVAILABLE
    with ExecutorClient(target, timeout=5) as after:
        with pytest.raises(ExecutorError) as gone:
            after.info()
    assert gone.value.code is grpc.StatusCode.UNAVAILABLE and gone.value.reason is None, gone.value


def test_the_port_file_says_draining_while_the_server_drains(tiny_llama_dir):
    """A live sequence holds the drain for its export grace; meanwhile the --port-file
    says "draining", so whoever reads it sends no new work here."""
    import json

    with ServerProcess(f"tiny={tiny_llama_dir}", "--no-warmup", "--kv-tokens", "256", "--export-grace", "30") as server:
        server.wait_serving(timeout=60)
        with ExecutorClient(server.target, timeout=30) as c:
            c.prefill([1, 2, 3, 4, 5])  # kept: the drain waits for it to be exported
        assert json.loads(server.port_file.read_text())["state"] == "serving"
        server.proc.send_signal(signal.SIGTERM)

        def state() -> str:
            try:
                return json.loads(server.port_file.read_text())["state"]
            except (OSError, ValueError):  # removed once the server exits: too late
                return "gone"

        assert wait_for(state, 20, "the port file to say draining", until=lambda s: s != "serving") == "draining"
        server.kill()
