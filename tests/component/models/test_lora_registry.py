"""The adapter registry (slots, byte accounting, LRU eviction of idle adapters,
pinning by users, replacement) and every adapter the reader refuses, each naming
the field at fault and leaving the registry as it was."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrum_rpc.server.models import load_model
from ferrum_rpc.server.models.config import ModelConfig
from ferrum_rpc.server.models.lora import AdapterSet
from ferrum_rpc.server.models.lora_read import AdapterError, read_adapter
from tests.conftest import TINY
from tests.component.models.lora_helpers import edit_config, make_adapter, run

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def small(tiny_llama_dir, tmp_path_factory):
    """Three small adapters on the tiny Llama (q/v only, rank 4) and a rank-8 one on everything."""
    root = tmp_path_factory.mktemp("small-adapters")
    qv = [make_adapter(tiny_llama_dir, root / f"qv{i}", seed=10 + i, r=4, alpha=4, targets=["q_proj", "v_proj"])
          for i in range(3)]
    return qv + [make_adapter(tiny_llama_dir, root / "all8", seed=20, r=8)]


@pytest.fixture
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir, torch.float32, CPU)


def _file_bytes(folder) -> int:
    """What the registry holds of the tiny Llama's adapter in ``folder`` (float32): the
    file's A and B matrices, nothing more (B transposed, no zeros for the modules a
    fused projection's adapter leaves alone)."""
    return sum(t.numel() * 4 for t in load_file(folder / "adapter_model.safetensors").values())


def test_slots_bytes_and_lru_eviction_of_idle_adapters(model, small):
    registry = AdapterSet(model, max_adapters=2, max_rank=16)
    assert model.adapters is registry
    a, b = registry.add("a", small[0]), registry.add("b", small[1])
    assert (a, b) == (0, 1)
    assert registry.nbytes == _file_bytes(small[0]) + _file_bytes(small[1])  # float32, as the files hold them
    assert [i["name"] for i in registry.info()] == ["a", "b"]
    assert registry.info()[0]["modules"] == ["q_proj", "v_proj"] and registry.info()[0]["rank"] == 4
    assert registry.get("a").digest != registry.get("b").digest
    with pytest.raises(AdapterError, match="already loaded") as e:
        registry.add("a", small[2])
    assert e.value.field == "name"
    registry.acquire("a")
    registry.release("a")  # a is now the more recently used: b goes first
    assert registry.add("c", small[2]) == b and registry.evicted == ["b"]
    assert registry.slot("c") == 1 and "b" not in {i["name"] for i in registry.info()}
    registry.acquire("a")
    registry.acquire("c")
    with pytest.raises(AdapterError, match="in use") as e:  # both pinned: no room
        registry.add("d", small[0])
    assert e.value.field == "max_adapters" and {i["name"] for i in registry.info()} == {"a", "c"}
    with pytest.raises(AdapterError, match="in use by 1 sequences"):
        registry.remove("c")
    registry.release("c")
    assert registry.add("d", small[0]) == 1 and registry.evicted == ["b", "c"]  # c idle again: evicted
    with pytest.raises(ValueError, match="released more often"):
        registry.release("d")
    with pytest.raises(AdapterError, match="unknown adapter"):
        registry.remove("c")
    registry.release("a")
    registry.remove("a")
    assert registry.slots[0] is None and registry.nbytes == _file_bytes(small[0])
    assert registry.add("e", small[1]) == 0  # the freed slot is reused


def test_a_byte_budget_evicts_or_refuses(model, small):
    one = _file_bytes(small[0])
    registry = AdapterSet(model, max_adapters=4, max_rank=16, max_bytes=one + one // 2)
    registry.add("a", small[0])
    registry.acquire("a")
    with pytest.raises(AdapterError, match="in use") as e:
        registry.add("b", small[1])
    assert e.value.field == "max_bytes"
    registry.release("a")
    registry.add("b", small[1])
    assert registry.evicted == ["a"] and registry.nbytes == one
    with pytest.raises(AdapterError, match="over the limit") as e:
        registry.add("big", small[3])
    assert e.value.field == "max_bytes" and [i["name"] for i in registry.info()] == ["b"]


def test_replace_takes_new_weights_in_the_same_slot(model, small):
    registry = AdapterSet(model, max_rank=16)
    slot = registry.add("a", small[0])
    registry.acquire("a")
    first = run(model, [[5, 6, 7]], [slot])[0]
    assert registry.add("a", small[3], replace=True) == slot
    assert registry.get("a").refs == 1 and registry.get("a").rank == 8
    second = run(model, [[5, 6, 7]], [slot])[0]
    registry.add("other", small[3])
    assert torch.equal(second, run(model, [[5, 6, 7]], [registry.slot("other")])[0])
    assert not torch.allclose(first, second)


def test_forward_refuses_slots_it_cannot_run(model, small):
    from ferrum_rpc.server.kv.pool import KvPool

    registry = AdapterSet(model, max_adapters=2, max_rank=16)
    registry.add("a", small[0])
    cfg = model.config
    kv = KvPool(cfg.num_layers, 4, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU).batch([[0]], [0], [2])
    ids = torch.tensor([[5, 6]])
    with pytest.raises(ValueError, match="slot 1 holds no adapter"):
        model(ids, kv.positions, kv, adapter_slots=torch.tensor([1]))
    with pytest.raises(ValueError, match="slot 7 holds no adapter"):
        model(ids, kv.positions, kv, adapter_slots=torch.tensor([7]))
    with pytest.raises(ValueError, match="adapter slots of shape"):
        model(ids, kv.positions, kv, adapter_slots=torch.tensor([[0, 0, 0]]))
    assert registry.deltas(torch.tensor([-1]), ids.shape) is None  # the base everywhere: no plan at all


CONFIG_REFUSALS = [
    ({"peft_type": "IA3"}, "peft_type", "only LORA"),
    ({"target_modules": ["q_proj", "lm_head"]}, "target_modules", "names a module that is not supported"),
    ({"use_dora": True}, "use_dora", "not supported"),
    ({"bias": "all"}, "bias", "only 'none'"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save", "not supported"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out", "not supported"),
    ({"lora_bias": True}, "lora_bias", "not supported"),
    ({"r": 32}, "r", "over the limit of 16"),
    ({"r": 0}, "r", "positive integer"),
    ({"rank_pattern": {"q_proj": 64}}, "rank_pattern", "in 1..16"),
    ({"lora_alpha": "big"}, "lora_alpha", "must be a number"),
    ({"layers_to_transform": [2]}, "layers_to_transform", "0..1"),
    ({"r": 4}, "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
     "shape \\(8, 128\\), this model needs \\(4, 128\\)"),
    ({"target_modules": ["q_proj", "v_proj"]}, "target_modules", "which target_modules does not name"),
]


@pytest.mark.parametrize("changes,field,says", CONFIG_REFUSALS, ids=[f for _, f, _ in CONFIG_REFUSALS])
def test_config_refusals_name_the_field(model, small, tmp_path, changes, field, says):
    registry = AdapterSet(model, max_rank=16)
    with pytest.raises(AdapterError, match=says) as e:
        registry.add("x", edit_config(small[3], tmp_path / "edited", **changes))
    assert e.value.field == field
    assert registry.info() == [] and registry.nbytes == 0 and registry.slots == [None] * 8


def _other_model_adapter(tmp_path, name: str, **config):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**{**TINY, **config})).save_pretrained(tmp_path / name)
    return make_adapter(tmp_path / name, tmp_path / f"{name}-adapter", seed=1, r=8)


def test_adapters_for_another_model_are_refused(model, tmp_path):
    registry = AdapterSet(model, max_rank=16)
    with pytest.raises(AdapterError, match="shape \\(32, 8\\), this model needs \\(64, 8\\).*another model") as e:
        registry.add("x", _other_model_adapter(tmp_path, "narrow", hidden_size=32, num_attention_heads=2,
                                               num_key_value_heads=1))
    assert e.value.field == "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"
    with pytest.raises(AdapterError, match="layer 2; this model has 2 layers") as e:
        registry.add("x", _other_model_adapter(tmp_path, "deep", num_hidden_layers=3))
    assert e.value.field == "layers" and registry.info() == []


def test_missing_and_stray_tensors_are_refused(model, small, tmp_path):
    registry = AdapterSet(model, max_rank=16)
    tensors = load_file(small[3] / "adapter_model.safetensors")
    cases = {  # the file's tensors edited -> (field, message)
        "no-B": ({k: v for k, v in tensors.items() if k != "base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"},
                 "adapter_model.safetensors", "missing tensor model.layers.1.mlp.up_proj.lora_B"),
        "no-gate": ({k: v for k, v in tensors.items() if ".gate_proj." not in k},
                    "adapter_model.safetensors", "missing tensors for layers.0.gate_proj, layers.1.gate_proj"),
        "lm-head": ({**tensors, "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)},
                    "base_model.model.lm_head.lora_A.weight", "not a LoRA A/B tensor"),
        "ints": ({**tensors, "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight":
                  torch.zeros(8, 64, dtype=torch.int32)},
                 "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", "not a float type"),
        "empty": ({}, "adapter_model.safetensors", "no LoRA tensors"),
    }
    for name, (edited, field, says) in cases.items():
        folder = edit_config(small[3], tmp_path / name)
        save_file(edited, folder / "adapter_model.safetensors")
        with pytest.raises(AdapterError, match=says) as e:
            registry.add("x", folder)
        assert e.value.field == field, name
    folder = edit_config(small[3], tmp_path / "torn")
    (folder / "adapter_model.safetensors").write_bytes((small[3] / "adapter_model.safetensors").read_bytes()[:100])
    with pytest.raises(AdapterError, match="unreadable"):
        registry.add("x", folder)
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(AdapterError, match="only safetensors") as e:
        registry.add("x", folder)
    assert e.value.field == "adapter_model.safetensors"
    (folder / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON") as e:
        registry.add("x", folder)
    assert e.value.field == "adapter_config.json"
    with pytest.raises(AdapterError, match="not a folder") as e:
        registry.add("x", tmp_path / "nowhere")
    assert e.value.field == "path" and registry.info() == [] and registry.nbytes == 0


def test_adapters_on_expert_layers_are_refused(tiny_moe_dir, small, tmp_path):
    """An MLP adapter on a mixture-of-experts layer has no dense projection to land on."""
    cfg = ModelConfig.from_dir(tiny_moe_dir)
    folder = edit_config(small[3], tmp_path / "moe")
    assert cfg.is_moe_layer(0) and not cfg.is_moe_layer(1)
    with pytest.raises(AdapterError, match="layer 0's MLP is a mixture of experts") as e:
        read_adapter(folder, cfg, 16, torch.float32)
    assert e.value.field == "target_modules"
    attention_only = edit_config(small[0], tmp_path / "moe-attn")
    config = json.loads((attention_only / "adapter_config.json").read_text())
    assert config["target_modules"] and read_adapter(attention_only, cfg, 16, torch.float32).modules == (
        "q_proj", "v_proj")
