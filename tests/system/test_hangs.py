"""Hung servers (issue 20, items 7 and 8): real ``ferrum-rpc serve`` processes frozen
with SIGSTOP and thawed with SIGCONT while clients hold calls and sequences on them.

- A replica that stops answering is left by keepalive (a ping unanswered within its
  timeout closes the transport: UNAVAILABLE), and its sequences fail over by replay,
  in-flight calls included, exactly as for a dead one.
- A call whose caller gave up (its deadline passed while the server was frozen) is not
  run when the server resumes: the clients send the absolute deadline
  (``ferrum-deadline-unix-ns``) and the server refuses work past it, so the caller's
  retry with the same handle succeeds.
- A replica-set client that timed out on a call treats a LENGTH_MISMATCH on that
  sequence's next call as "my call ran after all" and rebuilds the sequence from its
  history instead of surfacing a stale handle.

Every test thaws (SIGCONT) and kills what it froze in ``finally``.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait

import grpc
import pytest

from ferrum_rpc import convert
from ferrum_rpc.client import ExecutorClient, LengthMismatch, LogitsPolicy, connect
from ferrum_rpc.metadata import DEADLINE_HEADER
from ferrum_rpc.client.generate import generate_ids
from ferrum_rpc.client.replicas import ReplicaPolicy
from ferrum_rpc.errors import ExecutorError
from ferrum_rpc.harness import all_serving
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.system.test_replicas import GREEDY, Replica, prompts

FAST = ReplicaPolicy(status_ttl_s=0.5, down_cooldown_s=0.3, seed=0)


class Frozen:
    """SIGSTOP on a replica's process until :meth:`thaw` (idempotent; always call it)."""

    def __init__(self, replica: Replica):
        self.replica, self.stopped = replica, False

    def freeze(self) -> None:
        os.kill(self.replica.proc.pid, signal.SIGSTOP)
        self.stopped = True

    def thaw(self) -> None:
        if self.stopped and self.replica.alive():
            os.kill(self.replica.proc.pid, signal.SIGCONT)
        self.stopped = False


@pytest.fixture(scope="module")
def pair(tiny_llama_dir):
    with all_serving(*(Replica(tiny_llama_dir) for _ in range(2))) as replicas:
        try:
            yield replicas
        finally:
            for r in replicas:
                if r.alive():
                    os.kill(r.proc.pid, signal.SIGCONT)


@pytest.fixture
def fresh_pair(pair):
    """The pair, both serving; a test that left one unusable gets it restarted."""
    yield pair
    for r in pair:
        if r.alive():
            os.kill(r.proc.pid, signal.SIGCONT)
        else:
            r.restart()


def test_sigstopped_replica_is_left_and_its_generations_fail_over(fresh_pair):
    """6 greedy generations over two replicas, no call timeout.  When each has produced 5
    tokens, the replica owning the most of them is SIGSTOPped (and left stopped for far
    longer than the test waits).  Every generation must finish by failover well within
    15 s of the stop, with the tokens of an undisturbed single-server run.  Before
    keepalive, the callers on the stopped replica waited for as long as it was stopped."""
    targets = [r.target for r in fresh_pair]
    by_target = {r.target: r for r in fresh_pair}
    ps = prompts(6)
    with ExecutorClient(targets[1], timeout=30) as one:
        want = [list(generate_ids(one, list(p), 20, GREEDY)) for p in ps]
    ex = connect(targets, replica_policy=FAST)  # no timeout: only keepalive can tell
    owners: dict[int, str] = {}
    frozen: list[Frozen] = []
    stopped_at: list[float] = []

    def stop_busiest():
        counts = {t: list(owners.values()).count(t) for t in targets}
        victim = Frozen(by_target[max(counts, key=counts.get)])
        frozen.append(victim)
        victim.freeze()
        stopped_at.append(time.monotonic())

    barrier = threading.Barrier(len(ps), action=stop_busiest, timeout=60)

    def run(i: int) -> list[int]:
        got = []
        for token in generate_ids(ex, list(ps[i]), 20, GREEDY):
            got.append(token)
            if len(got) == 5:
                owners[i] = next(s.replica for s in ex.live_sequences() if s.tokens[:len(ps[i])] == ps[i])
                barrier.wait()
        return got

    pool = ThreadPoolExecutor(len(ps))
    try:
        futures = [pool.submit(run, i) for i in range(len(ps))]
        done, _ = wait(futures, timeout=25)  # the barrier (~1 s), then the stop
        assert stopped_at, "the replicas were never stopped"
        took = time.monotonic() - stopped_at[0]
        assert len(done) == len(futures), f"{len(futures) - len(done)} generation(s) still stuck after {took:.0f}s"
        assert took < 15, f"failover took {took:.1f}s after the stop"
        assert [f.result() for f in futures] == want
        victim = frozen[0].replica.target
        assert any(t == victim for t in owners.values()), "the stopped replica owned no sequence"
        assert all(s.replica != victim for s in ex.live_sequences())
    finally:
        for f in frozen:
            f.thaw()  # lets anything still stuck on it finish
        pool.shutdown(wait=True)
        ex.close()


def _stop_during_a_decode(replica: Replica, ex, token: int, handle, stop_s: float,
                          allowed=(grpc.StatusCode.DEADLINE_EXCEEDED,)) -> None:
    """SIGSTOP, one decode that runs past the client's deadline, SIGCONT ``stop_s`` after
    the stop (the decode's request sits in the frozen server's socket meanwhile)."""
    frozen = Frozen(replica)
    try:
        frozen.freeze()
        start = time.monotonic()
        with pytest.raises(ExecutorError) as caught:
            ex.decode(token, handle, logits=LogitsPolicy.argmax())
        # With keepalive on (a ping every 2 s, 2 s to answer) the ping's timeout and the
        # call's 2 s deadline race: either ends the call, and either must leave the
        # abandoned decode unrun on resume, which is what the caller checks next.
        assert caught.value.code in allowed, caught.value
        time.sleep(max(0.0, stop_s - (time.monotonic() - start)))  # workload: the hang lasts stop_s
    finally:
        frozen.thaw()


@pytest.mark.parametrize("keepalive", ["default", "off"])
def test_a_call_abandoned_during_a_hang_is_not_run_on_resume(fresh_pair, keepalive):
    """A 2 s timeout, the server stopped for 5 s under a decode, then SIGCONT and at once
    the same decode with the same handle: it must succeed with the undisturbed result
    (before: LENGTH_MISMATCH, since the server ran the abandoned decode on resume with a
    fresh 2 s deadline).  With keepalive off, only the deadline header can prevent it."""
    replica = fresh_pair[0]
    kwargs = {} if keepalive == "default" else {"keepalive": None}
    prompt = list(prompts(1)[0])
    with ExecutorClient(replica.target, timeout=30) as one:
        ref = one.prefill(prompt, logits=LogitsPolicy.argmax())
        token = int(ref.logits.argmax()[0])
        want = one.decode(token, ref.kv_cache, logits=LogitsPolicy.argmax())
        one.release_cache(want.kv_cache)
    with ExecutorClient(replica.target, timeout=2, **kwargs) as ex:
        out = ex.prefill(prompt, logits=LogitsPolicy.argmax())
        allowed = (grpc.StatusCode.DEADLINE_EXCEEDED,) + (
            (grpc.StatusCode.UNAVAILABLE,) if keepalive == "default" else ())
        _stop_during_a_decode(replica, ex, token, out.kv_cache, stop_s=5, allowed=allowed)
        step = ex.decode(token, out.kv_cache, logits=LogitsPolicy.argmax())  # right after the resume
        assert step.kv_cache.sequence_length == len(prompt) + 1
        assert int(step.logits.argmax()[0]) == int(want.logits.argmax()[0])
        ex.release_cache(step.kv_cache)


def test_a_call_past_its_absolute_deadline_is_refused_and_changes_nothing(fresh_pair):
    """The server side of the deadline header, through real gRPC: a decode whose
    ``ferrum-deadline-unix-ns`` has passed is DEADLINE_EXCEEDED even with gRPC's own
    timeout far off, and the sequence is untouched; a malformed value is ignored."""
    replica = fresh_pair[0]
    prompt = list(prompts(3)[2])
    with ExecutorClient(replica.target, timeout=30) as one, grpc.insecure_channel(replica.target) as channel:
        stub = pb_grpc.ModelExecutorStub(channel)
        out = one.prefill(prompt, logits=LogitsPolicy.argmax())
        token = int(out.logits.argmax()[0])
        request = pb.DecodeRequest(token_id=token, kv_cache=convert.handle_to_proto(out.kv_cache),
                                   logits=pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX))
        past = str(time.time_ns() - 1_000_000_000)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Decode(request, timeout=30, metadata=((DEADLINE_HEADER, past),))
        assert caught.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        garbage = ((DEADLINE_HEADER, "soon"),)
        step = convert.handle_from_proto(stub.Decode(request, timeout=30, metadata=garbage).kv_cache)
        assert step.sequence_length == len(prompt) + 1  # the refused call did not run
        one.release_cache(step)


class HoldingProxy:
    """A TCP proxy in front of a server whose replies can be held back (``hold``) and let
    through later (``release``): a call the server ran whose reply reaches the caller
    only after its deadline, as over a congested or briefly partitioned link."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.released = threading.Event()
        self.released.set()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = [self.listener]
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def hold(self) -> None:
        self.released.clear()

    def release(self) -> None:
        self.released.set()

    def _accept(self) -> None:
        host, port = self.upstream.rsplit(":", 1)
        while True:
            try:
                down, _ = self.listener.accept()
            except OSError:
                return
            up = socket.create_connection((host, int(port)))
            self.sockets += [down, up]
            threading.Thread(target=self._pump, args=(down, up, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, down, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(65536):
                if replies:
                    self.released.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.released.set()
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()


def test_replica_client_resyncs_a_sequence_its_timed_out_call_changed(fresh_pair):
    """The server ran a decode, but its reply reached the replica-set client only after the
    call's 2 s deadline (held in a proxy): the sequence is one token ahead of the caller's
    handle.  The client timed out on that sequence, so the LENGTH_MISMATCH its retry gets
    means "check the sequence": it rebuilds it from the remembered history (releasing the
    copy that ran ahead) and the retry returns the undisturbed result, instead of
    surfacing LengthMismatch."""
    a, b = fresh_pair
    proxy = HoldingProxy(a.target)
    try:
        targets = [proxy.target, b.target]
        before = {r.target: _free_blocks(r.target) for r in fresh_pair}
        # placed by load alone: KV events would send these prompts, which earlier tests ran,
        # to the replica whose cache still holds them
        with connect(targets, timeout=2, keepalive=None, replica_policy=replace(FAST, kv_events=False)) as ex:
            for prompt in map(list, prompts(8)):  # until one lands behind the proxy
                out = ex.prefill(prompt, logits=LogitsPolicy.argmax())
                if ex.replica_of(out.kv_cache) == proxy.target:
                    break
                ex.release_cache(out.kv_cache)
            assert ex.replica_of(out.kv_cache) == proxy.target
            token = int(out.logits.argmax()[0])
            with ExecutorClient(b.target, timeout=30) as one:
                ref = one.prefill(prompt, logits=LogitsPolicy.argmax())
                want = one.decode(token, ref.kv_cache, logits=LogitsPolicy.argmax())
                one.release_cache(want.kv_cache)
            proxy.hold()
            with pytest.raises(ExecutorError) as caught:
                ex.decode(token, out.kv_cache, logits=LogitsPolicy.argmax())
            assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, caught.value
            with ExecutorClient(a.target, timeout=30) as direct:  # the server did run it
                with pytest.raises(LengthMismatch):
                    direct.decode(token, out.kv_cache, logits=LogitsPolicy.argmax())
            proxy.release()
            step = ex.decode(token, out.kv_cache, logits=LogitsPolicy.argmax())
            assert step.kv_cache.sequence_length == len(prompt) + 1
            assert int(step.logits.argmax()[0]) == int(want.logits.argmax()[0])
            ex.release_cache(step.kv_cache)
            assert ex.live_sequences() == []
        assert {r.target: _free_blocks(r.target) for r in fresh_pair} == before  # the copy that ran ahead went
    finally:
        proxy.close()


def _free_blocks(target: str) -> int:
    with ExecutorClient(target, timeout=10) as one:
        return one.status().kv_blocks_free
