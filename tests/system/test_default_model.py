"""The real embedded model (SmolLM2-135M-Instruct) end to end through gRPC.

Prepares (converts) the model on first use; the converted folder is cached
under $FERRUM_RPC_HOME, so later runs start in seconds.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from ferrum_rpc.client import ExecutorClient, LogitsPolicy
from ferrum_rpc.client.generate import encode_prompt, generate_ids, load_tokenizer
from ferrum_rpc.client.sampling import SamplingParams
from tests.system.test_security import pki, tokens_file  # noqa: F401  (fixtures)
from tests.conftest import running_server

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def default_server(default_model_dir):
    with running_server(default_model_dir, name="SmolLM2-135M-Instruct", kv_tokens=4096, block_size=16,
                        server_kwargs=dict(warmup=False)) as server:
        yield server


def test_32_greedy_tokens_equal_transformers_generate(default_model_dir, default_server):
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(default_model_dir)
    prompt_ids = encode_prompt(tokenizer, "What is the capital of France? Answer in one long sentence.")
    oracle = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    oracle.generation_config.eos_token_id = None  # greedy straight through <|im_end|>, as our loop does
    with torch.no_grad():
        expected = oracle.generate(
            torch.tensor([prompt_ids]), max_new_tokens=32, do_sample=False,
        )[0, len(prompt_ids):].tolist()
    assert len(expected) == 32

    with ExecutorClient(default_server.target, timeout=60) as ex:
        got = list(generate_ids(ex, prompt_ids, 32, SamplingParams(greedy=True)))
        assert ex.status().active_sequences == 0  # generate_ids released its KV
    assert got == expected, (tokenizer.decode(got), tokenizer.decode(expected))


def test_batch_decode_on_the_real_model_matches_single_sequences(default_server):
    prompts = [[1, 504, 3458, 282], [1, 9690, 28, 2234, 314, 253, 1345], [1, 33]]
    with ExecutorClient(default_server.target, timeout=60) as ex:
        alone = []
        for p in prompts:
            out = ex.prefill(p, logits=LogitsPolicy.argmax())
            step = ex.decode(out.logits.argmax()[0], out.kv_cache, logits=LogitsPolicy.topk(8))
            alone.append(step.logits)
            ex.release_cache(step.kv_cache)
        outs = [ex.prefill(p, logits=LogitsPolicy.argmax()) for p in prompts]
        steps = ex.batch_decode([(o.logits.argmax()[0], o.kv_cache) for o in outs], logits=LogitsPolicy.topk(8))
        for step, ref in zip(steps, alone):
            assert list(step.logits.token_ids[0]) == list(ref.token_ids[0])
            assert abs(step.logits.values[0] - ref.values[0]).max() <= 1e-4
            ex.release_cache(step.kv_cache)


def test_real_model_rows_are_the_same_bits_alone_batched_cached_and_chunked(default_server):
    """Batch-invariant by default: a sequence's FULL decode logits are the same bits with
    its prompt cold and alone, from the prefix cache, in three parts, and inside
    BatchDecodes of 2, 7, 16 and 32 others of other lengths in shuffled order."""
    import random

    rng = random.Random(3)
    prompt = [1] + [rng.randrange(100, 40000) for _ in range(37)]  # two whole blocks of 16: cached
    others = [[1] + [rng.randrange(100, 40000) for _ in range(rng.randrange(4, 60))] for _ in range(32)]
    argmax = LogitsPolicy.argmax()
    with ExecutorClient(default_server.target, timeout=120) as ex:
        assert ex.capabilities().batch_invariant

        def row(n_others: int, parts: tuple[int, ...] = ()) -> bytes:
            handle = None
            for lo, hi in zip((0, *parts), (*parts, len(prompt))):
                handle = ex.prefill(prompt[lo:hi], kv_cache=handle, logits=argmax).kv_cache
            items = [(11, handle)] + [(7, ex.prefill(p, logits=argmax).kv_cache) for p in others[:n_others]]
            order = list(range(len(items)))
            random.Random(n_others).shuffle(order)
            outs = ex.batch_decode([items[i] for i in order], logits=LogitsPolicy.full())
            for out in outs:
                ex.release_cache(out.kv_cache)
            return outs[order.index(0)].logits.values.tobytes()

        cold = row(0)  # this prompt's first prefill on the server
        assert row(0) == cold  # from the prefix cache
        assert row(0, parts=(10, 24)) == cold
        for n in (2, 7, 16, 32):
            assert row(n) == cold, n


def test_greedy_speculative_equals_greedy_on_the_real_model(default_model_dir, default_server):
    from ferrum_rpc.client.speculative import speculative_generate

    tokenizer = load_tokenizer(default_model_dir)
    prompt_ids = encode_prompt(tokenizer, "List the numbers from 1 to 20, separated by commas.")
    with ExecutorClient(default_server.target, timeout=60) as ex:
        expected = list(generate_ids(ex, prompt_ids, 48, SamplingParams(greedy=True)))
        result = speculative_generate(ex, prompt_ids, 48, k=4)
    assert result.tokens == expected
    assert result.accepted > 0 and result.target_forwards < len(expected)


def _cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ferrum_rpc.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_cli_generate_answers_through_the_server(default_server):
    proc = _cli("generate", "--target", default_server.target, "--greedy", "--max-tokens", "24",
                "What is the capital of France?")
    assert proc.returncode == 0, proc.stderr
    assert "Paris" in proc.stdout
    assert "tokens/s" in proc.stderr  # the run's figures are logged


def test_cli_generate_over_mtls_with_a_token(default_model_dir, pki, tokens_file, tmp_path):
    from tests.system.test_security import ALICE

    server_kwargs = dict(tls_cert=str(pki / "server.pem"), tls_key=str(pki / "server.key"),
                         tls_client_ca=str(pki / "ca.pem"), auth_tokens=tokens_file, warmup=False)
    token = tmp_path / "token"
    token.write_text(ALICE + "\n")
    with running_server(default_model_dir, name="SmolLM2-135M-Instruct", kv_tokens=1024, block_size=16,
                        server_kwargs=server_kwargs) as server:
        args = ["generate", "--target", server.target, "--greedy", "--max-tokens", "24",
                "--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "client.pem"),
                "--tls-key", str(pki / "client.key"), "What is the capital of France?"]
        proc = _cli(*args, "--token-file", str(token))
        assert proc.returncode == 0, proc.stderr
        assert "Paris" in proc.stdout
        refused = _cli(*args)  # no token
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
        assert ALICE not in proc.stderr + refused.stderr


def test_cli_speculative_reports_acceptance_and_matches_plain(default_server):
    proc = _cli("generate", "--target", default_server.target, "--speculative", "4", "--max-tokens", "40",
                "List the numbers from 1 to 20, separated by commas.")
    assert proc.returncode == 0, proc.stderr  # non-zero when the outputs differ
    assert "acceptance" in proc.stderr and "speed-up" in proc.stderr and "identical" in proc.stderr


@pytest.fixture(scope="module")
def english_ids(default_model_dir):
    from pathlib import Path

    text = (Path(__file__).parents[1] / "data" / "english.txt").read_text()
    ids = load_tokenizer(default_model_dir)(text)["input_ids"]
    assert len(ids) >= 1001
    return ids[:1001]


@pytest.fixture(scope="module")
def float32_top1(default_server, english_ids):
    """float32's next-token argmax at every position of ``english_ids``, through gRPC."""
    with ExecutorClient(default_server.target, timeout=120) as ex:
        out = ex.prefill(english_ids, logits=LogitsPolicy.argmax(all_positions=True))
        ex.release_cache(out.kv_cache)
    return out.logits.argmax()


# The gates are 99% for w8a8 and 97% for w4a8 (README: 99.5% and 97.6% measured with a
# step per half block of 16, w8a8's activations rotated and its LM head on two digits, 98.9%
# with the rotation's adds in another order; 98.5% for w8a8 unrotated, 96.7% and 96.8% with one
# step per block of 32).  The figure moves by about
# half a point between kernels that compute the same numbers: every layer of the packed kernel
# agrees with the torch fallback on the same codes to 1.2e-6 of its output, yet 4% of the argmaxes
# over 300 positions differ between the two models, because rounding activations to a grid is
# discontinuous and a flipped code moves the next layer's input by a whole step.  So this test
# guards against breakage (a wrong code, a lost step or scale) a point below what was measured,
# and ``bench.quant_accuracy`` reports the figure.  int8 and int4 hold the GGUF's weights without
# loss (the test below) and carry activations as two int8 digits (about 15 bits a block):
# 99.9-100.0% measured for both.  w8a8 and w4a8 hold a bfloat16 KV pool (--kv-dtype auto):
# 98.9% and 98.1% measured with it.
AGREEMENT = {"int8": 0.995, "int4": 0.995, "w8a8": 0.985, "w4a8": 0.965}


@pytest.fixture(scope="module", params=list(AGREEMENT))
def quantized(request, default_model_dir):
    """The default model served with --quantize (each mode once, for both tests below)."""
    with running_server(default_model_dir, name="q", kv_tokens=4096, block_size=16, quantize=request.param,
                        server_kwargs=dict(warmup=False)) as server:
        server.quantize = request.param
        yield server


def test_quantized_greedy_top1_agrees_with_float32(quantized, float32_top1, english_ids):
    """Teacher-forced over 1,000 positions of a fixed English text: the next-token argmax of
    the quantized model against float32's, both served through gRPC."""
    quantize, target = quantized.quantize, AGREEMENT[quantized.quantize]
    policy = LogitsPolicy.argmax(all_positions=True)
    reference = float32_top1
    with ExecutorClient(quantized.target, timeout=120) as ex:
        assert ex.capabilities().quantization == quantize
        out = ex.prefill(english_ids, logits=policy)
        got = out.logits.argmax()
        ex.release_cache(out.kv_cache)
    agreement = sum(a == b for a, b in zip(got, reference)) / len(reference)
    print(f"{quantize}: top-1 agreement with float32 over {len(reference)} positions: {agreement:.2%}")
    assert len(reference) == 1001 and agreement >= target


@pytest.fixture(scope="module")
def float32_aten(default_model_dir):
    """The default model in float32 on plain torch linears (its weights as loaded)."""
    from ferrum_rpc.server.config import ExecutorConfig
    from ferrum_rpc.server.engine.executor import TorchExecutor

    return TorchExecutor.from_path("f", default_model_dir, ExecutorConfig(kv_tokens=64, linear_kernel="aten"))


def test_quantized_layers_hold_the_gguf_weights_without_loss(quantized, float32_aten):
    """The embedded GGUF's projections are Q4_1 and its tied head Q8_0: int8 and int4 must reproduce
    the float32 weights (dequantized from them) up to float32 rounding, so quantizing loses nothing;
    w8a8 holds its projections rotated (qact.rotate_codes), every one of them, and still loses nothing."""
    from ferrum_rpc.server.kernels import woq

    quantize, dense = quantized.quantize, float32_aten
    quant = quantized.app.registry.workers["q"].executor
    dense_modules = dict(dense.model.named_modules())
    checked = 0
    for name, module in quant.model.named_modules():
        if isinstance(module, woq.QuantizedLinear):
            weight = dense_modules[name].weight
            err = (module.dequantized() - weight).abs().max().item()
            assert err <= 1e-5 * weight.abs().max().item(), name
            checked += 1
    assert checked == 4 * quant.model_config.num_layers + 1  # qkv, o, gate_up, down per layer; the head
    rotated = sum(getattr(m, "rotated", False) for m in quant.model.modules())
    assert rotated == (4 * quant.model_config.num_layers if quantize == "w8a8" else 0)


def test_the_node_client_generates_what_the_python_client_does(default_model_dir, default_server):
    """clients/node (grpc-js + proto-loader on the .proto alone) against the real model:
    greedy tokens through Decode, BatchDecode and a DecodeSession equal the Python
    client's, and both error shapes decode to the table's reasons."""
    import json

    from tests.node_env import node_packages

    node_dir = node_packages()
    tokenizer = load_tokenizer(default_model_dir)
    prompt_ids = encode_prompt(tokenizer, "Name three rivers of Europe.")
    with ExecutorClient(default_server.target, timeout=60) as ex:
        expected = list(generate_ids(ex, prompt_ids, 24, SamplingParams(greedy=True)))
    done = subprocess.run(["node", "client.js", default_server.target, *map(str, prompt_ids), "--tokens", "24"],
                          cwd=node_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert got["model"] == "SmolLM2-135M-Instruct"
    assert got["greedy"] == expected, (tokenizer.decode(got["greedy"]), tokenizer.decode(expected))
    assert got["batch"] == [expected, expected]
    assert got["session"] == expected
    assert got["session_error_reason"] == "LENGTH_MISMATCH"
    assert got["unary_error_reason"] == "STALE_HANDLE"
    with ExecutorClient(default_server.target, timeout=60) as ex:
        assert ex.status().active_sequences == 0  # the Node client released everything it made


def test_streamed_text_is_decoded_incrementally_and_exactly(default_model_dir):
    """`generate`'s streaming: the incremental decoder's deltas join to exactly what
    decoding all ids at once gives, multi-byte characters (split across byte-level
    tokens) included, and it decodes each token once."""
    from ferrum_rpc.client.generate import _stream_by_redecoding, stream_text

    tokenizer = load_tokenizer(default_model_dir)
    text = "Héllo wörld — 東京タワー 🎉🇫🇷 naïve café, Ωμέγα ≠ ∑; done."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # byte-level pieces: characters span tokens
    deltas = list(stream_text(tokenizer, iter(ids), set()))
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert all("\ufffd" not in d for d in deltas)  # never half a character
    assert "".join(_stream_by_redecoding(tokenizer, iter(ids), set())) == text  # the fallback agrees
    stop = ids[5]
    assert "".join(stream_text(tokenizer, iter(ids), {stop})) == tokenizer.decode(ids[:ids.index(stop)])
