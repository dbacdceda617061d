"""A newcomer's path, on the real default model behind a live server: every Python
block of README.md and docs/*.md runs as printed (only the README's address,
127.0.0.1:50051, becomes the test server's), the quickstart example is the README's
first block, the client's text tools match transformers' without importing it,
and a token id the wire cannot carry is INVALID_INPUT naming its field."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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
BLOCK = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)
# Pages whose Python blocks are fragments of a larger setup (several replicas, an
# adapter folder, a weights file) and do not run against one local server yet.
FRAGMENT_PAGES = {"docs/replicas.md", "docs/weights.md"}


def python_blocks(page: Path) -> list[str]:
    return BLOCK.findall(page.read_text())


PAGES = [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if python_blocks(p)]


@pytest.fixture(scope="module")
def default_model_dir():
    from ferrum_rpc.server.prepare import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="module")
def server(default_model_dir):
    with running_server(default_model_dir, name="SmolLM2-135M-Instruct", kv_tokens=4096, block_size=16,
                        server_kwargs=dict(warmup=False)) as server:
        yield server


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_runs_as_printed(page, server, capsys):
    """The blocks of a page run in order, in one namespace (a later block may use what an
    earlier one made, as a reader would), against the live server."""
    name = str(page.relative_to(ROOT))
    if name in FRAGMENT_PAGES:
        pytest.skip(f"{name}: its blocks are fragments (see FRAGMENT_PAGES)")
    namespace = {"__name__": "__doc_snippet__"}
    for i, block in enumerate(python_blocks(page)):
        code = compile(block.replace(DOC_ADDRESS, server.target), f"{name}[block {i}]", "exec")
        exec(code, namespace)
    with ExecutorClient(server.target, timeout=30) as ex:
        assert ex.status().active_sequences == 0, f"{name}'s blocks left sequences behind"


def test_every_fragment_page_still_parses():
    for page in PAGES:
        for i, block in enumerate(python_blocks(page)):
            compile(block, f"{page.name}[block {i}]", "exec")


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
