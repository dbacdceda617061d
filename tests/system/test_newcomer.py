"""A newcomer's path, on the real default model behind a live server: every Python
block of README.md and docs/*.md runs as printed (only the docs' addresses and folders
become the test's: 127.0.0.1:50051 the test server, 127.0.0.1:50052 a second one for the
replica pages, /adapters/ a folder of LoRA adapters made for the model), the quickstart
example is the README's first block, the client's text tools match transformers'
without importing it, and a token id the wire cannot carry is INVALID_INPUT naming its
field."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import grpc
import numpy as np
import pytest

from ferrum_rpc.client import ExecutorClient, InvalidInput, LogitsPolicy
from ferrum_rpc.errors import Reason, from_rpc_error
from tests.conftest import running_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
DOC_ADDRESS = "127.0.0.1:50051"
DOC_SECOND_ADDRESS = "127.0.0.1:50052"  # a second replica (docs/replicas.md)
DOC_ADAPTERS = "/adapters/"  # LoRA adapter folders (docs/weights.md)
# A fenced block, at any indentation (a block inside a list item is indented with it).
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```$", re.S | re.M)


def python_blocks(page: Path) -> list[str]:
    return [textwrap.dedent(body) for _, lang, body in FENCE.findall(page.read_text()) if lang == "python"]


PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if python_blocks(p)]


def run_blocks(blocks: list[str], name: str, substitutions: dict[str, str]) -> dict:
    """Runs a page's blocks in order in one namespace (a later block may use what an
    earlier one made, as a reader would), each with the docs' addresses and folders
    replaced; an error names the page and the block."""
    namespace = {"__name__": "__doc_snippet__"}
    for i, block in enumerate(blocks):
        for doc, real in substitutions.items():
            block = block.replace(doc, real)
        exec(compile(block, f"{name}[block {i}]", "exec"), namespace)
    return namespace


@pytest.fixture(scope="module")
def server(default_model_dir):
    with running_server(default_model_dir, name="SmolLM2-135M-Instruct", kv_tokens=4096, block_size=16,
                        server_kwargs=dict(warmup=False)) as server:
        yield server


@pytest.fixture(scope="module")
def second_server(default_model_dir):
    """Another server on the default model: the second replica of docs/replicas.md."""
    with running_server(default_model_dir, name="SmolLM2-135M-Instruct", kv_tokens=4096, block_size=16,
                        server_kwargs=dict(warmup=False)) as server:
        yield server


@pytest.fixture(scope="module")
def adapters(default_model_dir, tmp_path_factory) -> Path:
    """A folder holding the LoRA adapter "sql" docs/weights.md loads: PEFT's files, rank 4
    on layer 0's q_proj and v_proj, small random weights (written here: no peft needed)."""
    from safetensors.numpy import save_file

    config = json.loads((default_model_dir / "config.json").read_text())
    hidden, head_dim = config["hidden_size"], config["hidden_size"] // config["num_attention_heads"]
    out_dims = {"q_proj": hidden, "v_proj": config["num_key_value_heads"] * head_dim}
    root = tmp_path_factory.mktemp("adapters")
    folder, rank, rng = root / "sql", 4, np.random.default_rng(0)
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 8, "target_modules": list(out_dims),
        "layers_to_transform": [0], "bias": "none"}))
    save_file({f"base_model.model.model.layers.0.self_attn.{m}.lora_{ab}.weight":
               (rng.standard_normal(shape) * 0.01).astype(np.float32)
               for m, out in out_dims.items() for ab, shape in (("A", (rank, hidden)), ("B", (out, rank)))},
              str(folder / "adapter_model.safetensors"))
    return root


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs_as_printed(page, server, request):
    """The blocks of a page run in order against the live server(s); afterwards no
    server holds a sequence the blocks made."""
    name, text = str(page.relative_to(ROOT)), page.read_text()
    substitutions, servers = {DOC_ADDRESS: server.target}, [server]
    if DOC_SECOND_ADDRESS in text:
        second = request.getfixturevalue("second_server")
        substitutions[DOC_SECOND_ADDRESS] = second.target
        servers.append(second)
    if DOC_ADAPTERS in text:
        substitutions[DOC_ADAPTERS] = f"{request.getfixturevalue('adapters')}/"
    run_blocks(python_blocks(page), name, substitutions)
    for srv in servers:
        with ExecutorClient(srv.target, timeout=30) as ex:
            assert ex.status().active_sequences == 0, f"{name}'s blocks left sequences behind on {srv.target}"


def test_every_python_block_of_the_docs_is_run():
    """No Python hides from the runner: each page's ```python fences (at any indentation)
    are the blocks it runs, and no block under another label (or none) is client code."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        assert len(python_blocks(page)) == len(re.findall(r"^ *```python$", text, re.M)), page.name
        assert len(re.findall(r"^ *```", text, re.M)) == 2 * len(FENCE.findall(text)), f"{page.name}: an unclosed fence"
        for _, lang, body in FENCE.findall(text):
            if lang == "python" or "ferrum_rpc" not in body:
                continue
            try:
                compile(textwrap.dedent(body), page.name, "exec")
            except SyntaxError:
                continue
            pytest.fail(f"{page.name}: a ```{lang} block is Python that no test runs: {body[:80]!r}")


def test_a_broken_block_fails_naming_its_page_and_block():
    blocks = ["x = 1\n", "assert x == 2, 'the doc is wrong'\n"]
    with pytest.raises(AssertionError, match="the doc is wrong") as info:
        run_blocks(blocks, "docs/example.md", {})
    assert traceback.extract_tb(info.value.__traceback__)[-1].filename == "docs/example.md[block 1]"
    assert run_blocks(["y = '127.0.0.1:50051'\n"], "p", {DOC_ADDRESS: "h:1"})["y"] == "h:1"


def test_the_readme_quickstart_is_examples_quickstart():
    example = (ROOT / "examples" / "quickstart.py").read_text()
    body = example[example.index("import numpy as np"):]
    assert python_blocks(ROOT / "README.md")[0] == body


def test_np_argmax_of_logits_is_the_greedy_token(server):
    with ExecutorClient(server.target, timeout=30) as ex:
        out = ex.prefill([1, 504, 3458, 282])
        top = ex.prefill([1, 504, 3458, 282], logits=LogitsPolicy.topk(5))
        greedy = out.logits.argmax()[0]
        assert greedy != 0
        assert int(np.argmax(out.logits)) == greedy
        assert int(np.argmax(top.logits)) == greedy
        assert np.asarray(top.logits).shape == (1, ex.info().vocab_size)
        for h in (out.kv_cache, top.kv_cache):
            ex.release_cache(h)


def test_a_negative_token_id_is_invalid_input_naming_its_field(server):
    with ExecutorClient(server.target, timeout=30) as ex:
        out = ex.prefill([1, 2, 3])
        cases = [(lambda: ex.prefill([1, -1]), "token_ids[1]"),
                 (lambda: ex.decode(-1, out.kv_cache), "token_id"),
                 (lambda: ex.batch_decode([(-5, out.kv_cache)]), "items.token_id"),
                 (lambda: ex.forward_verify([2, -3], out.kv_cache), "token_ids[1]"),
                 (lambda: ex.speculative_decode(2, [-1], out.kv_cache), "draft[0]"),
                 (lambda: ex.batch_prefill([[1, 2], [-7]]), "prompts.token_ids[0]"),
                 (lambda: ex.prefill([1, 2**32]), "token_ids[1]"),
                 (lambda: ex.prefill([1, "2"]), "token_ids[1]")]
        for call, field in cases:
            with pytest.raises(InvalidInput, match=re.escape(field)):
                call()
        assert ex.status().active_sequences == 1  # nothing reached the server
        ex.release_cache(out.kv_cache)


def test_the_server_refuses_a_raw_callers_negative_token_id(server):
    """Raw bytes with -1 as a ten-byte varint (what a careless encoder writes for an int
    in a uint32 field): INVALID_INPUT, not a crash nor a token."""
    minus_one = bytes([0xFF] * 9 + [0x01])
    body = b"\x12" + bytes([len(minus_one) + 1]) + b"\x01" + minus_one  # token_ids = [1, -1], packed
    with grpc.insecure_channel(server.target) as channel:
        prefill = channel.unary_unary("/ferrum.executor.v1.ModelExecutor/Prefill")
        with pytest.raises(grpc.RpcError) as info:
            prefill(body, timeout=30)
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert from_rpc_error(info.value).reason is Reason.INVALID_INPUT
    assert "vocabulary" in info.value.details()


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France? é 日本 \U0001f600"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}],
]


def test_the_chat_template_renders_as_transformers_does(default_model_dir):
    from transformers import AutoTokenizer

    from ferrum_rpc.client.text import load_tokenizer

    ours, theirs = load_tokenizer(default_model_dir), AutoTokenizer.from_pretrained(str(default_model_dir))
    assert ours.eos_token_id == theirs.eos_token_id
    for messages in CONVERSATIONS:
        for add in (True, False):
            assert ours.render_chat(messages, add) == theirs.apply_chat_template(
                messages, add_generation_prompt=add, tokenize=False)
            assert ours.apply_chat_template(messages, add) == list(theirs.apply_chat_template(
                messages, add_generation_prompt=add, tokenize=True, return_dict=False))
    text = "Once upon a time, in a land far away"
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.decode(ours(text)["input_ids"]) == theirs.decode(theirs(text)["input_ids"], skip_special_tokens=True)


BLOCK_HEAVY = ("import sys\n"
               "for name in ('transformers', 'torch'):\n"
               "    sys.modules[name] = None  # importing either now fails\n"
               "from ferrum_rpc.cli import main\n"
               "sys.exit(main(sys.argv[1:]))\n")


def test_generate_imports_neither_transformers_nor_torch(server, default_model_dir):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", BLOCK_HEAVY, "generate", "--target", server.target, "--greedy",
                           "--max-tokens", "8", "--tokenizer", str(default_model_dir),
                           "What is the capital of France?"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    assert "Paris" in done.stdout
