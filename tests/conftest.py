"""Fixtures: tiny random checkpoints written with transformers, and real
in-process gRPC servers on port 0 hosting them."""

from __future__ import annotations

import contextlib
import logging
import os

import pytest
import torch

from ferrum_rpc.client import ExecutorClient
from ferrum_rpc.server.app import BackgroundServer
from ferrum_rpc.server.config import ExecutorConfig, ModelSpec, ServerConfig

logging.getLogger("ferrum_rpc").setLevel(logging.INFO)

# The device the servers these tests start run their models on: "cpu", or "cuda" on a GPU
# machine (FERRUM_TEST_DEVICE=cuda), where the tests of the contract run against CUDA executors.
TEST_DEVICE = os.environ.get("FERRUM_TEST_DEVICE", "cpu")

TINY = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def pytest_collection_modifyitems(config, items):
    """With FERRUM_TEST_DEVICE set to a GPU, the tests of CPU paths skip (their servers would
    refuse those options there, or report other kernels)."""
    if TEST_DEVICE == "cpu":
        return
    skip = pytest.mark.skip(reason=f"a CPU path; this run's servers are on {TEST_DEVICE}")
    for item in items:
        if "cpu_only" in item.keywords:
            item.add_marker(skip)


def pytest_sessionstart(session):
    """Compiles the CPU kernels before any test runs (a minute on 2 cores when their sources
    changed), so that no test's timeout and no server's start-up wait include the build.
    A build that fails is left for the tests that need the kernels to report."""
    from ferrum_rpc.server.kernels.build import build_extension

    try:
        build_extension()
    except Exception as error:  # noqa: BLE001 (each kernel test reports it in its own words)
        logging.getLogger(__name__).warning("CPU kernels not built before the session: %s", error)


def _save_tiny(path, config_cls, model_cls, seed: int, **extra):
    torch.manual_seed(seed)
    model = model_cls(config_cls(**{**TINY, **extra})).eval()  # extra may override TINY
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def default_model_dir():
    """The embedded SmolLM2-135M-Instruct, prepared once (cached under cache_root())."""
    from ferrum_rpc.server.prepare import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-llama"), LlamaConfig, LlamaForCausalLM, seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-qwen3"), Qwen3Config, Qwen3ForCausalLM, seed=1,
                      head_dim=16, tie_word_embeddings=False)


@pytest.fixture(scope="session")
def tiny_q4_llama_dir(tmp_path_factory):
    """tiny_llama's architecture with every decoder projection's weights on GGUF's
    Q4_1 grid (16 levels a block of 32), as the embedded model's come out of its
    GGUF: w8a8 rotates these (qact.RotatedQ8Linear), not weights from float."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ferrum_rpc.server.kernels import woq

    torch.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
                module.weight.copy_(woq.QuantizedLinear(module.weight, None, 4, woq.DEQUANT).dequantized())
    path = tmp_path_factory.mktemp("tiny-q4-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def wide_vocab_dir(tmp_path_factory):
    """A tiny Llama with an 8,192-token vocabulary: a FULL float32 row is 32 KiB, so a few
    replies fill an HTTP/2 flow-control window and 200 rows take the reply-builder thread."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _save_tiny(tmp_path_factory.mktemp("tiny-wide-vocab"), LlamaConfig, LlamaForCausalLM, seed=3,
                      vocab_size=8192, max_position_embeddings=512)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(2)
    cfg = Qwen3MoeConfig(**TINY, head_dim=16, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                         norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1])
    model = Qwen3MoeForCausalLM(cfg).eval()
    # random init leaves experts nearly identical; spread them so routing matters
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    path = tmp_path_factory.mktemp("tiny-moe")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def hf_tiny_llama(tiny_llama_dir):
    """The oracle: transformers' own Llama on the same weights."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_oracle(model_dir, arch: str):
    """transformers' own model of ``arch`` ("llama" or "qwen3") on ``model_dir``'s weights,
    in float32 on the CPU: the oracle of the parity tests."""
    from transformers import LlamaForCausalLM, Qwen3ForCausalLM

    cls = {"llama": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}[arch]
    return cls.from_pretrained(model_dir, dtype=torch.float32).eval()


@torch.no_grad()
def oracle_rows(hf, ids: list[int], kv_dtype: torch.dtype | None = None):
    """transformers' logits for every position of ``ids`` (T, V), as numpy; ``kv_dtype``:
    its cache's keys and values rounded to that dtype as they are stored (and given back
    widened), the oracle for a pool of that dtype under float32 (--kv-dtype)."""
    if kv_dtype is None:
        return hf(torch.tensor([ids])).logits[0].numpy()
    from transformers import DynamicCache

    class Rounded(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            rounded = lambda t: t.to(kv_dtype).to(t.dtype)  # noqa: E731
            return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)

    return hf(torch.tensor([ids]), past_key_values=Rounded(), use_cache=True).logits[0].numpy()


def executor_snapshot(ex) -> dict:
    """Everything a failed call must leave as it was in a TorchExecutor's KV state."""
    seqs = {cid: (s.length, list(s.tokens), list(s.block_ids), s.last_used, s.pins)
            for cid, s in ex.kv.snapshot().sequences.items()}
    return {"seqs": seqs, "used": ex.kv.num_used, "free": ex.kv.num_free}


@contextlib.contextmanager
def running_server(model_dir, name: str = "tiny", server_kwargs: dict | None = None, **executor_kwargs):
    """A real gRPC server on a free loopback port hosting one model
    (``server_kwargs``: ServerConfig fields such as TLS files and tokens)."""
    executor_kwargs.setdefault("kv_tokens", 2048)
    executor_kwargs.setdefault("device", TEST_DEVICE)
    executor_kwargs.setdefault("block_size", 4)
    config = ServerConfig(models=(ModelSpec(name, str(model_dir)),), port=0,
                          executor=ExecutorConfig(**executor_kwargs), **(server_kwargs or {}))
    with BackgroundServer(config) as server:
        yield server


TENANT_TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-9876543210"}  # tenants_server's


@contextlib.contextmanager
def tenants_server(model_dir, tmp_path_factory, admin_tenants: tuple[str, ...] = (), **executor_kwargs):
    """:func:`running_server` with bearer tokens: tenants alice and bob (TENANT_TOKENS),
    ``admin_tenants`` of them admins."""
    tokens = tmp_path_factory.mktemp("auth") / "tokens"
    tokens.write_text("".join(f"{name} {token}\n" for name, token in TENANT_TOKENS.items()))
    with running_server(model_dir, server_kwargs=dict(auth_tokens=str(tokens), admin_tenants=admin_tenants),
                        **executor_kwargs) as server:
        yield server


@pytest.fixture
def alice(server):
    """A client of tenant alice (TENANT_TOKENS) on the module's ``server``."""
    with ExecutorClient(server.target, timeout=30, token=TENANT_TOKENS["alice"]) as c:
        yield c


@pytest.fixture
def bob(server):
    """A client of tenant bob (TENANT_TOKENS) on the module's ``server``."""
    with ExecutorClient(server.target, timeout=30, token=TENANT_TOKENS["bob"]) as c:
        yield c


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir):
    with running_server(tiny_llama_dir) as server:
        yield server


@pytest.fixture
def client(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=30) as c:
        yield c
