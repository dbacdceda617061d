"""Adapters the server can trust, through real gRPC on the tiny Llama: folders whose
tensors or scaling could only give non-finite logits are refused; --adapter-root
confines every file an adapter load reads (symbolic links and /proc paths followed);
refusals never echo what a file holds; ListAdapters shows a tenant who is no admin
only what is its own to see; and a load reads and builds its adapter before it
waits for the model's worker."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.errors import ExecutorError, Reason
from ferrum_rpc.harness import all_serving
from tests.conftest import TENANT_TOKENS, running_server, tenants_server
from tests.component.models.lora_helpers import edit_config, make_adapter
from tests.waiting import wait_for

pytestmark = pytest.mark.timeout(300)

PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]
FULL = LogitsPolicy()
A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B_KEY = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
SECRET = "S3CRET-from-a-file"


@pytest.fixture(scope="module")
def good(tiny_llama_dir, tmp_path_factory):
    return make_adapter(tiny_llama_dir, tmp_path_factory.mktemp("good") / "a", seed=1, r=8)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, good):
    with running_server(tiny_llama_dir, kv_tokens=2048, loras=(("a", str(good)),), max_adapters=4) as srv:
        yield srv


@pytest.fixture
def client(server):
    with ExecutorClient(server.target, timeout=60) as c:
        yield c


def rows(out) -> np.ndarray:
    return np.asarray(out.logits.values, dtype=np.float32).reshape(-1, out.logits.vocab_size)


def with_tensor(folder: Path, out: Path, key: str, edit) -> Path:
    """A copy of the adapter in ``folder`` with tensor ``key`` replaced by ``edit(tensor)``."""
    edit_config(folder, out)
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors[key] = edit(tensors[key].clone())
    save_file(tensors, out / "adapter_model.safetensors")
    return out


def _poke(value: float, dtype: torch.dtype):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dtype)
        t[0, 0] = value
        return t
    return edit


NON_FINITE = {  # case -> (the folder made from the good adapter, the field the refusal names)
    "nan": (lambda a, out: with_tensor(a, out, A_KEY, _poke(float("nan"), torch.float32)), A_KEY),
    "inf_float16": (lambda a, out: with_tensor(a, out, B_KEY, _poke(float("inf"), torch.float16)), B_KEY),
    "overflows_float32": (lambda a, out: with_tensor(a, out, A_KEY, _poke(1e300, torch.float64)), A_KEY),
    "overflows_once_scaled": (lambda a, out: with_tensor(a, out, B_KEY, _poke(3e38, torch.float32)), B_KEY),
    "alpha_nan": (lambda a, out: edit_config(a, out, lora_alpha=float("nan")), "lora_alpha"),
    "alpha_1e38": (lambda a, out: edit_config(a, out, lora_alpha=1e38), "lora_alpha"),
    "alpha_pattern_inf": (lambda a, out: edit_config(a, out, alpha_pattern={"q_proj": float("inf")}),
                          "alpha_pattern"),
}


@pytest.mark.parametrize("case", list(NON_FINITE))
def test_adapters_that_could_only_give_nan_logits_are_refused(client, good, tmp_path, case):
    """Each folder here loaded OK and then gave all-NaN logits; now LoadAdapter refuses
    it, naming the tensor or field, and nothing changes: the held adapter and the base
    still serve finite logits."""
    make, field = NON_FINITE[case]
    folder = make(good, tmp_path / case)
    before = [(e.name, e.digest) for e in client.list_adapters()]
    with pytest.raises(ExecutorError) as refused:
        client.load_adapter("bad", str(folder))
    assert refused.value.reason is Reason.ADAPTER_INVALID, refused.value
    assert field in str(refused.value)
    assert [(e.name, e.digest) for e in client.list_adapters()] == before
    for adapter in ("a", ""):
        out = client.prefill(PROMPT, logits=FULL, adapter=adapter)
        assert np.isfinite(rows(out)).all()
        client.release_cache(out.kv_cache)


def test_the_largest_scaling_allowed_still_loads(client, good, tmp_path):
    """The bound on lora_alpha / r (1024) is a bound, not a refusal of large ones: r 8 with
    lora_alpha 8192 loads, and its scaling is reported."""
    entry = client.load_adapter("edge", str(edit_config(good, tmp_path / "edge", lora_alpha=8192)))
    assert entry.scaling == 1024.0
    client.unload_adapter("edge")


HOSTILE_CONFIGS = {  # a config field set to what the file must not leak -> the field the refusal names
    "peft_type": SECRET, "bias": SECRET, "use_dora": SECRET, "lora_alpha": SECRET, "r": SECRET,
    "target_modules": ["q_proj", SECRET], "layers_to_transform": [SECRET], "rank_pattern": {SECRET: 999},
}


@pytest.mark.parametrize("field", list(HOSTILE_CONFIGS))
def test_refusals_name_the_field_and_never_echo_what_the_file_holds(client, good, tmp_path, field):
    folder = edit_config(good, tmp_path / field, **{field: HOSTILE_CONFIGS[field]})
    with pytest.raises(ExecutorError) as refused:
        client.load_adapter("bad", str(folder))
    assert refused.value.reason is Reason.ADAPTER_INVALID
    assert field in str(refused.value) and SECRET not in str(refused.value), str(refused.value)


def test_a_json_file_that_is_no_adapter_config_is_not_echoed(client, tmp_path):
    """A folder holding any JSON file the server can read as adapter_config.json: the
    refusal says what was expected, not what the file says."""
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": SECRET, "password": SECRET}))
    with pytest.raises(ExecutorError) as refused:
        client.load_adapter("bad", str(tmp_path))
    assert refused.value.reason is Reason.ADAPTER_INVALID and SECRET not in str(refused.value)
    (tmp_path / "adapter_config.json").write_bytes(b"\xff" + SECRET.encode())
    with pytest.raises(ExecutorError) as refused:
        client.load_adapter("bad", str(tmp_path))
    assert "adapter_config.json" in str(refused.value) and SECRET not in str(refused.value)


# -- --adapter-root ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rooted(tiny_llama_dir, good, tmp_path_factory):
    """A server with --adapter-root: inside it the good adapter, a link to it, and folders
    whose links lead out; outside it a copy of the good adapter."""
    base = tmp_path_factory.mktemp("rooted")
    root, outside = base / "root", base / "outside"
    shutil.copytree(good, root / "a")
    shutil.copytree(good, outside / "a")
    (root / "inner-link").symlink_to(root / "a")
    (root / "escape").symlink_to(outside / "a")
    for name, linked in (("weights-out", "adapter_model.safetensors"), ("config-out", "adapter_config.json")):
        (root / name).mkdir()
        for file in ("adapter_model.safetensors", "adapter_config.json"):
            source = outside / "a" / file
            if file == linked:
                (root / name / file).symlink_to(source)
            else:
                shutil.copy(source, root / name / file)
    with running_server(tiny_llama_dir, kv_tokens=1024, max_adapters=4, adapter_root=str(root)) as srv:
        yield srv, root, outside


ESCAPES = {  # how the path is written -> it names a folder or file outside the root
    "outside": lambda root, outside: outside / "a",
    "dot_dot": lambda root, outside: root / ".." / "outside" / "a",
    "folder_link": lambda root, outside: root / "escape",
    "weights_link": lambda root, outside: root / "weights-out",
    "config_link": lambda root, outside: root / "config-out",
    "proc_root": lambda root, outside: Path(f"/proc/self/root{outside / 'a'}"),
    "proc_cwd": lambda root, outside: Path("/proc/self/cwd"),
}


@pytest.mark.parametrize("case", list(ESCAPES))
def test_adapter_root_refuses_every_path_that_leads_outside_it(rooted, case):
    server, root, outside = rooted
    with ExecutorClient(server.target, timeout=60) as c:
        before = [(e.name, e.digest) for e in c.list_adapters()]
        with pytest.raises(ExecutorError) as refused:
            c.load_adapter("x", str(ESCAPES[case](root, outside)))
        assert refused.value.reason is Reason.ADAPTER_INVALID, refused.value
        assert "--adapter-root" in str(refused.value), str(refused.value)
        assert [(e.name, e.digest) for e in c.list_adapters()] == before


def test_adapter_root_serves_what_lies_inside_it(rooted, good):
    server, root, _ = rooted
    with ExecutorClient(server.target, timeout=60) as c:
        direct = c.load_adapter("in", str(root / "a"))
        linked = c.load_adapter("in-link", str(root / "inner-link"))  # a link that stays inside
        assert direct.digest == linked.digest
        out = c.prefill(PROMPT, logits=FULL, adapter="in")
        assert np.isfinite(rows(out)).all()
        c.release_cache(out.kv_cache)
        for name in ("in", "in-link"):
            c.unload_adapter(name)


def test_serve_takes_adapter_root(tiny_llama_dir, good, tmp_path):
    """``ferrum-rpc serve --adapter-root DIR``: --lora and LoadAdapter inside it load,
    a folder outside it is refused."""
    from tests.system.test_replicas import Replica

    root = tmp_path / "root"
    shutil.copytree(good, root / "a")
    with all_serving(Replica(tiny_llama_dir, "--adapter-root", str(root), "--lora", f"a={root / 'a'}")) as (srv,):
        with ExecutorClient(srv.target, timeout=60) as c:
            assert [e.name for e in c.list_adapters()] == ["a"]
            c.load_adapter("b", str(root / "a"))
            with pytest.raises(ExecutorError) as refused:
                c.load_adapter("c", str(good))
            assert refused.value.reason is Reason.ADAPTER_INVALID and "--adapter-root" in str(refused.value)


# -- ListAdapters per tenant --------------------------------------------------------------


def test_list_adapters_shows_a_tenant_only_its_own(tiny_llama_dir, good, tmp_path_factory):
    """Alice (an admin) sees every field and every tenant's live sequences; Bob sees each
    adapter's name, rank and modules, and his own live sequences only: no path, digest,
    bytes or scaling, and not Alice's sequences."""
    with tenants_server(tiny_llama_dir, tmp_path_factory, admin_tenants=("alice",)) as srv:
        with ExecutorClient(srv.target, timeout=60, token=TENANT_TOKENS["alice"]) as alice, \
                ExecutorClient(srv.target, timeout=60, token=TENANT_TOKENS["bob"]) as bob:
            alice.load_adapter("a", str(good))
            held = [alice.prefill(PROMPT, adapter="a").kv_cache for _ in range(2)]
            held.append(bob.prefill(PROMPT, adapter="a").kv_cache)
            (full,) = alice.list_adapters()
            assert full.path == str(good) and len(full.digest) == 64 and full.bytes > 0 and full.scaling == 2.0
            assert full.sequences == 3
            (seen,) = bob.list_adapters()
            assert (seen.name, seen.rank, len(seen.target_modules)) == ("a", 8, 7)
            assert (seen.path, seen.digest, seen.bytes, seen.scaling) == ("", "", 0, 0.0)
            assert seen.sequences == 1
            bob.release_cache(held.pop())
            assert bob.list_adapters()[0].sequences == 0 and alice.list_adapters()[0].sequences == 2
            for handle in held:
                alice.release_cache(handle)


# -- loads off the worker -----------------------------------------------------------------


def test_a_load_reads_its_adapter_before_it_waits_for_the_worker(server, good, tmp_path):
    """The model's worker is held.  A LoadAdapter reads, checks and builds the adapter
    beside it, and only then queues its install; once that is queued the folder can
    go (nothing is read on the worker), and when the worker is free the adapter loads
    with the digest of the files as they were."""
    folder = shutil.copytree(good, tmp_path / "moving")
    worker = server.app.servicer.gate.workers["tiny"]
    gate = threading.Event()
    held = worker.submit(gate.wait, 60)
    result: dict = {}

    def load() -> None:
        with ExecutorClient(server.target, timeout=60) as c:
            try:
                result["entry"] = c.load_adapter("moved", str(folder))
            except ExecutorError as exc:
                result["error"] = exc

    loader = threading.Thread(target=load)
    try:
        wait_for(held.running, 30, "the worker to take the holding job")
        loader.start()
        # the load's job, queued once its adapter is built
        wait_for(lambda: worker.queue_depth, 30, "the load to queue on the worker")
        shutil.rmtree(folder)
    finally:
        gate.set()
        loader.join(60)
    assert "error" not in result, result.get("error")
    with ExecutorClient(server.target, timeout=60) as c:
        want = c.load_adapter("reference", str(good)).digest
        assert result["entry"].digest == want
        out = c.prefill(PROMPT, logits=FULL, adapter="moved")
        assert np.isfinite(rows(out)).all()
        c.release_cache(out.kv_cache)
        for name in ("moved", "reference"):
            c.unload_adapter(name)
