"""The server's token choice on the real SmolLM2-135M served by a real
``ferrum-rpc serve`` process, and on the tiny model, through real gRPC, against
oracles that share no code with server/choice/sampling.py:

- greedy with each penalty and with a logit bias equals transformers ``generate``
  on the same weights, 40 tokens, token for token. transformers has a repetition
  penalty and a sequence bias processor; presence and frequency penalties (OpenAI's
  and vLLM's definition, over the output tokens only) it has not, so the oracle is
  transformers' own forward logits inside its own ``generate`` with a processor
  written here from OpenAI's formula;
- the distribution a sampled token is drawn from equals transformers' warpers on the
  same FULL logits row (1e-5 in probability), and the tokens many seeds draw pass a
  chi-square test against transformers' distribution;
- a seed draws the same tokens alone and as one of 16 mixed sequences in a
  DecodeSession;
- a caller-side grammar (llguidance, a JSON schema) sends its mask each step and the
  model's output parses and validates, greedy and sampled; without the mask the same
  calls choose a token the grammar forbids at once;
- every bad-input row of the error table, on every call that takes a token choice, is
  INVALID_ARGUMENT and changes nothing.
"""

from __future__ import annotations

import json
import math

import grpc
import numpy as np
import pytest
import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ferrum_rpc import tensor_codec
from ferrum_rpc.client import DecodeInput, ExecutorClient, LogitsPolicy, LogprobsMode, TokenChoice
from ferrum_rpc.client.generate import encode_prompt, load_tokenizer
from ferrum_rpc.harness import ServerProcess
from ferrum_rpc.rules import pack_allowed_tokens, unpack_allowed_tokens
from ferrum_rpc.v1 import executor_pb2 as pb
from ferrum_rpc.v1 import executor_pb2_grpc as pb_grpc
from tests.conftest import oracle_rows
from tests.unit.choice.test_sampling import _chi_square_bound

STEPS = 40
TINY_PROMPT = [1, 17, 42, 99, 5, 230, 17, 8]


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def smol(default_model_dir):
    """A ``ferrum-rpc serve`` process serving the default model (no warm-up: the tests
    measure nothing), and a client of it."""
    with ServerProcess(None, "--kv-tokens", "4096", "--block-size", "16", "--no-warmup") as server:
        server.wait_serving(300)
        with ExecutorClient(server.target, timeout=300) as client:
            yield client


@pytest.fixture(scope="module")
def smol_tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def smol_oracle(default_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # straight through <|im_end|>, as the server's loop
    return model


@pytest.fixture(scope="module")
def tiny(tiny_server):
    with ExecutorClient(tiny_server.target, timeout=60) as client:
        yield client


# ---------------------------------------------------------------------------- the oracles

class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties, written from the API reference:
    ``logit[j] -= count[j] * frequency + (count[j] > 0) * presence``, count over the
    tokens generated so far (``input_ids`` past the prompt)."""

    def __init__(self, prompt_length: int, presence: float = 0.0, frequency: float = 0.0):
        self.prompt_length, self.presence, self.frequency = prompt_length, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        counts = torch.stack([torch.bincount(row[self.prompt_length:], minlength=scores.shape[-1])
                              for row in input_ids]).to(scores.dtype)  # (B, V)
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class OnRows(LogitsProcessor):
    """``processor`` on some rows of the batch only: every case in one ``generate``."""

    def __init__(self, rows: list[int], processor: LogitsProcessor):
        self.rows, self.processor = rows, processor

    def __call__(self, input_ids, scores):
        scores = scores.clone()
        scores[self.rows] = self.processor(input_ids[self.rows], scores[self.rows])
        return scores


def _transformers_greedy(model, prompt: list[int], processors: list[list[LogitsProcessor]], steps: int) -> list:
    """One batched greedy ``generate``: row i runs ``processors[i]`` in order."""
    listed = LogitsProcessorList(OnRows([i], p) for i, row in enumerate(processors) for p in row)
    config = GenerationConfig(do_sample=False, max_new_tokens=steps, min_new_tokens=0, eos_token_id=None,
                              pad_token_id=0, bos_token_id=None)
    ids = torch.tensor([prompt] * len(processors))  # (B, T): one prompt, no padding
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                             logits_processor=listed)
    return out[:, len(prompt):].tolist()


def _served(client, prompt: list[int], choices: list[TokenChoice], steps: int) -> list[list]:
    """BatchPrefill the prompt once per choice, then BatchDecode the chosen tokens:
    each sequence's ``steps`` chosen tokens (ChosenToken)."""
    outs = client.batch_prefill([prompt] * len(choices), token_choice=choices)
    got, handles = [[o.chosen] for o in outs], [o.kv_cache for o in outs]
    while len(got[0]) < steps:
        step = client.batch_decode([DecodeInput(g[-1].token_id, h, c) for g, h, c in zip(got, handles, choices)])
        for g, o in zip(got, step):
            g.append(o.chosen)
        handles = [o.kv_cache for o in step]
    for h in handles:
        client.release_cache(h)
    return got


def _penalty_cases(prompt_length: int, bias: dict[int, float]) -> list[tuple[str, TokenChoice, list]]:
    """(name, our policy, transformers' processors in the server's order) per case."""
    sequence_bias = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])
    return [
        ("plain", TokenChoice.greedy(), []),
        ("repetition", TokenChoice.greedy(repetition_penalty=1.3), [RepetitionPenaltyLogitsProcessor(1.3)]),
        ("presence", TokenChoice.greedy(presence_penalty=1.5), [OpenAIPenalties(prompt_length, presence=1.5)]),
        ("frequency", TokenChoice.greedy(frequency_penalty=0.8), [OpenAIPenalties(prompt_length, frequency=0.8)]),
        ("bias", TokenChoice.greedy(logit_bias=bias), [sequence_bias]),
        ("all", TokenChoice.greedy(logit_bias=bias, repetition_penalty=1.1, presence_penalty=0.5,
                                   frequency_penalty=0.3),
         [sequence_bias, RepetitionPenaltyLogitsProcessor(1.1), OpenAIPenalties(prompt_length, 0.5, 0.3)]),
    ]


def _assert_each_case_equals_transformers(client, model, prompt, bias, steps, show=str):
    cases = _penalty_cases(len(prompt), bias)
    served = _served(client, prompt, [c for _, c, _ in cases], steps)
    expected = _transformers_greedy(model, prompt, [p for _, _, p in cases], steps)
    ours = {name: [c.token_id for c in got] for (name, _, _), got in zip(cases, served)}
    for (name, _, _), want in zip(cases, expected):
        assert len(want) == steps
        assert ours[name] == want, (name, show(ours[name]), show(want))
        if name != "plain":
            assert ours[name] != ours["plain"], f"{name} changed nothing: a useless case"
    return ours


# ---------------------------------------------------------------------------- greedy with penalties and bias

@pytest.mark.slow
def test_greedy_with_each_penalty_and_a_bias_equals_transformers_on_smollm2(smol, smol_oracle, smol_tokenizer):
    prompt = encode_prompt(smol_tokenizer, "Write a short story about a cat who loves the rain.")
    words = {w: smol_tokenizer.encode(w, add_special_tokens=False) for w in (" cat", " rain", " dog")}
    assert all(len(ids) == 1 for ids in words.values())
    bias = {words[" cat"][0]: -100.0, words[" rain"][0]: -3.0, words[" dog"][0]: 4.0}
    ours = _assert_each_case_equals_transformers(smol, smol_oracle, prompt, bias, STEPS, smol_tokenizer.decode)
    assert words[" cat"][0] not in ours["bias"]


def test_greedy_with_each_penalty_and_a_bias_equals_transformers_on_the_tiny_model(tiny, hf_tiny_llama):
    _assert_each_case_equals_transformers(tiny, hf_tiny_llama, TINY_PROMPT, {7: 4.0, 150: 2.5, 33: -100.0}, 24)


# ---------------------------------------------------------------------------- sampling

def _warped(row: torch.Tensor, choice: TokenChoice) -> torch.Tensor:
    """(V,) float64: transformers' warpers on one logits row, softmaxed."""
    scores = row.double().unsqueeze(0)
    warpers = [TemperatureLogitsWarper(choice.temperature)]
    warpers += [TopKLogitsWarper(choice.top_k)] if choice.top_k else []
    warpers += [TopPLogitsWarper(choice.top_p)] if choice.top_p < 1 else []
    warpers += [MinPLogitsWarper(choice.min_p)] if choice.min_p else []
    for warper in warpers:
        scores = warper(None, scores)
    return scores.softmax(-1)[0]


@pytest.mark.slow
def test_the_sampled_distribution_equals_transformers_warpers_on_smollm2(smol, smol_tokenizer):
    """One BatchPrefill, FULL logits and a PROCESSED top-20 per item: the listed tokens
    are the 20 most likely of transformers' distribution, each within 1e-5."""
    prompt = encode_prompt(smol_tokenizer, "Name a colour.")
    choices = [TokenChoice(temperature=0.7, top_k=20), TokenChoice(temperature=1.0, top_p=0.6),
               TokenChoice(temperature=0.9, min_p=0.1), TokenChoice(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
               TokenChoice(temperature=1.0)]
    choices = [TokenChoice(**{**c.__dict__, "seed": 5, "top_logprobs": 20, "logprobs_mode": LogprobsMode.PROCESSED})
               for c in choices]
    outs = smol.batch_prefill([prompt] * len(choices), logits=LogitsPolicy.full(), token_choice=choices)
    for out, choice in zip(outs, choices):
        reference = _warped(torch.from_numpy(out.logits.values[0].copy()), choice)
        listed = {t.token_id: math.exp(t.logprob) for t in out.chosen.top_logprobs}
        top = reference.topk(len(listed))
        assert len(listed) == min(20, int((reference > 0).sum()))
        assert set(listed) == set(top.indices.tolist()), choice
        assert max(abs(listed[t] - p) for t, p in zip(top.indices.tolist(), top.values.tolist())) <= 1e-5, choice
        assert reference[out.chosen.token_id] > 0  # drawn from inside the distribution
        smol.release_cache(out.kv_cache)


def test_the_tokens_many_seeds_draw_pass_a_chi_square_test(tiny, hf_tiny_llama):
    """2400 seeds draw the token after TINY_PROMPT + [5] (forks of one sequence, one
    BatchDecode of 60 a round); the counts against transformers' distribution on its
    own forward logits: Pearson's statistic under the 1 - 1e-6 quantile (categories
    expected fewer than 5 times pooled), so a correct sampler fails once in a million.
    Power, measured once: the served draws score 2.9 against a bound of 44; against a
    sampler at temperature 1.2 instead of 0.9 they score 137, with the bias scaled by
    0.8, 164 (a temperature of 0.8 instead, 38, goes unseen: the unit test's 20,000
    draws in tests/unit/choice/test_sampling.py are the fine check)."""
    bias = {11: 3.0, 12: 2.5, 13: 2.0, 14: 1.5, 15: 1.0, 16: 0.5}  # shape the tiny model's flat distribution
    policy = TokenChoice(temperature=0.9, top_k=9, logit_bias=bias)
    row = torch.from_numpy(oracle_rows(hf_tiny_llama, TINY_PROMPT + [5])[-1].copy())
    context = torch.tensor([TINY_PROMPT + [5]])
    row = SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()])(context, row.unsqueeze(0))[0]
    probs = _warped(row, policy)
    root = tiny.prefill(TINY_PROMPT, logits=LogitsPolicy.argmax()).kv_cache
    drawn = []
    for first in range(0, 2400, 60):
        children = tiny.fork_cache(root, 60)
        outs = tiny.batch_decode([DecodeInput(5, h, TokenChoice(**{**policy.__dict__, "seed": first + i}))
                                  for i, h in enumerate(children)])
        drawn += [o.chosen.token_id for o in outs]
        for o in outs:
            tiny.release_cache(o.kv_cache)
    tiny.release_cache(root)
    assert tiny.status().active_sequences == 0
    assert all(probs[t] > 0 for t in drawn), "drew a token the distribution excludes"
    counts = torch.bincount(torch.tensor(drawn), minlength=len(probs)).double()
    expected = probs * len(drawn)
    big = expected >= 5
    observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
    wanted = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
    keep = wanted > 0
    statistic = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    assert int(big.sum()) >= 5  # enough categories for the test to mean something
    assert statistic < _chi_square_bound(int(keep.sum()) - 1)


def test_a_seed_draws_the_same_tokens_alone_and_among_16_mixed_sequences_in_a_session(tiny):
    """Ours alone (Prefill, Decodes), then ours 8th of 16 sequences of other lengths and
    policies (greedy, its own seed at other positions, other seeds, no choice,
    penalties, a mask, a bias, filters) in one BatchPrefill and a DecodeSession: the
    same token ids. A row's logits in a batch differ from its logits alone in the last
    bits (asserted <= 1e-5 here; on SmolLM2 up to ~5e-5, batched linears take another
    kernel), so logprobs agree to 1e-5, and a draw landing that close to a boundary of
    its inverse CDF could move: the tiny model keeps that chance negligible."""
    ours = TokenChoice(temperature=0.8, top_p=0.95, seed=20261123, repetition_penalty=1.1, top_logprobs=3)
    full, steps = LogitsPolicy.full(), 12
    out = tiny.prefill(TINY_PROMPT, token_choice=ours, logits=full)
    alone, rows, handle = [out.chosen], [out.logits.values[0]], out.kv_cache
    while len(alone) < steps:
        out = tiny.decode(alone[-1].token_id, handle, token_choice=ours, logits=full)
        alone.append(out.chosen)
        rows.append(out.logits.values[0])
        handle = out.kv_cache
    tiny.release_cache(handle)

    others = [TokenChoice.greedy(), TokenChoice(temperature=0.8, top_p=0.95, seed=20261124), None,
              TokenChoice(temperature=1.2, top_k=50, seed=1), TokenChoice(min_p=0.1, seed=2),
              TokenChoice.greedy(presence_penalty=1.0, frequency_penalty=0.5),
              TokenChoice(seed=3, allowed_token_bitmask=pack_allowed_tokens(range(0, 320, 3), 320)),
              TokenChoice(seed=4, logit_bias={11: 5.0, 30: -100.0}), None, TokenChoice(temperature=0.3),
              TokenChoice(top_p=0.5, seed=ours.seed), TokenChoice.greedy(repetition_penalty=1.5),
              TokenChoice(temperature=2.0, top_k=5, seed=6, logprobs_mode=LogprobsMode.PROCESSED, top_logprobs=2),
              TokenChoice(seed=7, top_logprobs=20), TokenChoice(temperature=0.8, top_p=0.95, seed=ours.seed + 1)]
    rng = np.random.default_rng(22)
    prompts = [rng.integers(3, 320, size=n).tolist() for n in (1, 3, 5, 7, 9, 12, 2, 8, 15, 4, 6, 10, 11, 20, 13)]
    prompts[4] = list(TINY_PROMPT)  # ours again, under other policies: shares its prefix blocks
    prompts, policies = prompts[:7] + [TINY_PROMPT] + prompts[7:], others[:7] + [ours] + others[7:]
    outs = tiny.batch_prefill(prompts, token_choice=policies, logits=full)

    def pick(o):
        return o.chosen.token_id if o.chosen is not None else int(np.argmax(o.logits.values[0]))

    got, batched = [outs[7].chosen], [outs[7].logits.values[0]]
    handles, nexts = [o.kv_cache for o in outs], [pick(o) for o in outs]
    with tiny.decode_session() as session:
        while len(got) < steps:
            step = session.step([DecodeInput(t, h, c) for t, h, c in zip(nexts, handles, policies)], logits=full)
            got.append(step[7].chosen)
            batched.append(step[7].logits.values[0])
            handles, nexts = [o.kv_cache for o in step], [pick(o) for o in step]
    for h in handles:
        tiny.release_cache(h)
    assert max(float(np.abs(a - b).max()) for a, b in zip(batched, rows)) <= 1e-5  # the last bits only
    assert [c.token_id for c in got] == [c.token_id for c in alone]
    assert np.allclose([c.logprob for c in got], [c.logprob for c in alone], atol=1e-5, rtol=0)
    assert [[t.token_id for t in c.top_logprobs] for c in got] == [[t.token_id for t in c.top_logprobs]
                                                                   for c in alone]
    assert len({c.token_id for c in alone}) > 3 and tiny.status().active_sequences == 0


# ---------------------------------------------------------------------------- a caller-side grammar

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK = "Give me a JSON object with the name and age of a fictional person."


@pytest.fixture(scope="module")
def person_grammar(default_model_dir, smol_tokenizer):
    """llguidance's tokenizer built from the model's tokenizer.json (the tokenizers
    library's serialisation), and the PERSON schema's grammar."""
    llguidance = pytest.importorskip("llguidance")
    from tokenizers import Tokenizer

    vocab = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = llguidance.LLTokenizer(Tokenizer.from_file(str(default_model_dir / "tokenizer.json")).to_str(),
                                       n_vocab=vocab, eos_token=smol_tokenizer.eos_token_id)
    return tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(PERSON)), vocab


def _constrained(client, prompt, choice, grammar, eos: int, limit: int = 64) -> list[int]:
    """Decodes with ``choice`` plus the grammar's mask of each step (llguidance's numpy
    helper fills an int32 row; its bytes go in ``allowed_token_bitmask``) until the
    grammar accepts the end token. Checks on every step that the server's reading of
    the bytes (ferrum_rpc/rules.unpack_allowed_tokens) allows exactly the tokens
    llguidance's own apply_token_bitmask_inplace leaves finite."""
    import llguidance
    import llguidance.numpy

    tokenizer, schema, vocab = grammar
    matcher = llguidance.LLMatcher(tokenizer, schema, log_level=1)
    words = llguidance.numpy.allocate_token_bitmask(1, vocab)  # (1, ceil(V / 32)) int32

    def masked() -> TokenChoice:
        llguidance.numpy.fill_next_token_bitmask(matcher, words)
        applied = np.zeros((1, vocab), dtype=np.float32)
        llguidance.numpy.apply_token_bitmask_inplace(applied, words)
        mask = words[0].tobytes()
        assert np.array_equal(unpack_allowed_tokens(mask, vocab), np.isfinite(applied[0]))  # the same layout
        return TokenChoice(**{**choice.__dict__, "allowed_token_bitmask": mask})

    out = client.prefill(prompt, token_choice=masked())
    tokens, handle = [], out.kv_cache
    while True:
        token = out.chosen.token_id
        assert matcher.consume_token(token), matcher.get_error()  # the server chose an allowed token
        if token == eos:
            break
        tokens.append(token)
        assert len(tokens) < limit, "the grammar did not end"
        out = client.decode(token, handle, token_choice=masked())
        handle = out.kv_cache
    client.release_cache(handle)
    assert matcher.is_stopped() and not matcher.is_error()
    return tokens


def _is_person(text: str) -> bool:
    """PERSON's schema checked by hand: an object of exactly a string name and an integer age."""
    document = json.loads(text)
    return (isinstance(document, dict) and set(document) == {"name", "age"} and isinstance(document["name"], str)
            and isinstance(document["age"], int) and not isinstance(document["age"], bool))


@pytest.mark.slow
def test_a_caller_side_json_grammar_mask_makes_smollm2_answer_in_the_schema(smol, smol_tokenizer, person_grammar):
    prompt = encode_prompt(smol_tokenizer, ASK)
    eos = smol_tokenizer.eos_token_id
    greedy, sampled = TokenChoice.greedy(), TokenChoice(temperature=0.8, seed=1)
    texts = [smol_tokenizer.decode(_constrained(smol, prompt, c, person_grammar, eos)) for c in (greedy, sampled)]
    assert all(_is_person(t) for t in texts), texts
    assert texts[0] != texts[1]  # it sampled

    # the mask is what does it: unmasked, the same calls start a Markdown fence, a
    # token the grammar forbids at the first step, and the greedy text is no JSON
    import llguidance
    import llguidance.numpy

    tokenizer, schema, vocab = person_grammar
    first = llguidance.numpy.allocate_token_bitmask(1, vocab)
    llguidance.numpy.fill_next_token_bitmask(llguidance.LLMatcher(tokenizer, schema, log_level=1), first)
    allowed = unpack_allowed_tokens(first[0].tobytes(), vocab)
    for choice in (greedy, sampled):
        out = smol.prefill(prompt, token_choice=choice)
        assert not allowed[out.chosen.token_id], smol_tokenizer.decode([out.chosen.token_id])
        tokens, handle = [out.chosen.token_id], out.kv_cache
        while choice is greedy and len(tokens) < 24:
            out = smol.decode(tokens[-1], handle, token_choice=choice)
            tokens.append(out.chosen.token_id)
            handle = out.kv_cache
        smol.release_cache(handle)
        if choice is greedy:
            with pytest.raises(json.JSONDecodeError):
                json.loads(smol_tokenizer.decode(tokens, skip_special_tokens=True))


# ---------------------------------------------------------------------------- bad input changes nothing

BAD = [  # (the field named, a bad policy): every token_choice row of the README's error table
    ("temperature", pb.TokenChoice(temperature=math.nan)),
    ("temperature", pb.TokenChoice(temperature=-0.5)),
    ("temperature", pb.TokenChoice(temperature=math.inf)),
    ("top_p", pb.TokenChoice(top_p=0.0)),
    ("top_p", pb.TokenChoice(top_p=1.5)),
    ("min_p", pb.TokenChoice(min_p=-0.1)),
    ("min_p", pb.TokenChoice(min_p=1.01)),
    ("repetition_penalty", pb.TokenChoice(repetition_penalty=0.0)),
    ("repetition_penalty", pb.TokenChoice(repetition_penalty=math.inf)),
    ("presence_penalty", pb.TokenChoice(presence_penalty=2.5)),
    ("frequency_penalty", pb.TokenChoice(frequency_penalty=-2.01)),
    ("frequency_penalty", pb.TokenChoice(frequency_penalty=math.nan)),
    ("logit_bias", pb.TokenChoice(logit_bias={320: 1.0})),  # the tiny vocabulary is 0 ..= 319
    ("logit_bias", pb.TokenChoice(logit_bias={3: math.inf})),
    ("logit_bias", pb.TokenChoice(logit_bias={3: -100.5})),
    ("top_logprobs", pb.TokenChoice(top_logprobs=21)),
    ("allowed_token_bitmask", pb.TokenChoice(allowed_token_bitmask=b"\xff" * 12)),  # 320 tokens: 40 bytes
    ("allowed_token_bitmask", pb.TokenChoice(allowed_token_bitmask=bytes(40))),  # allows no token
    ("logprobs_mode", pb.TokenChoice(logprobs_mode=7)),  # no such mode
]


@pytest.fixture(scope="module")
def stub(tiny_server):
    with grpc.insecure_channel(tiny_server.target) as channel:
        yield pb_grpc.ModelExecutorStub(channel)


def _refused(call, words: list[str]) -> None:
    with pytest.raises(grpc.RpcError) as info:
        reply = call()
        if not isinstance(reply, (pb.PrefillResponse, pb.DecodeResponse, pb.SpeculativeDecodeResponse)):
            list(reply)  # a stream: the error comes with its first message
    assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT, info.value
    for word in words:
        assert word in info.value.details(), info.value.details()


@pytest.mark.parametrize("field, bad", BAD, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD)])
def test_each_bad_token_choice_on_each_call_is_invalid_and_changes_nothing(stub, hf_tiny_llama, field, bad):
    """Prefill (new and continuing), Decode, BatchDecode and BatchPrefill with the bad
    policy on their second item, DecodeSession, SpeculativeDecode: INVALID_ARGUMENT
    naming the field (and the item); the status is as before, and the sequence the
    calls named still continues from its handle with transformers' logits."""
    argmax = pb.LogitsPolicy(kind=pb.LOGITS_KIND_ARGMAX)
    handle = stub.Prefill(pb.PrefillRequest(token_ids=[3, 7, 11], logits=argmax), timeout=30).kv_cache
    other = stub.Prefill(pb.PrefillRequest(token_ids=[4, 8], logits=argmax), timeout=30).kv_cache
    good = pb.TokenChoice(temperature=0.0)
    before = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    named, item = f"token_choice.{field}", f"items[1].token_choice.{field}"
    _refused(lambda: stub.Prefill(pb.PrefillRequest(token_ids=[3, 7], token_choice=bad), timeout=30), [named])
    _refused(lambda: stub.Prefill(pb.PrefillRequest(token_ids=[9], kv_cache=handle, token_choice=bad), timeout=30),
             [named])
    _refused(lambda: stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, token_choice=bad), timeout=30), [named])
    _refused(lambda: stub.BatchDecode(pb.BatchDecodeRequest(items=[
        pb.DecodeItem(kv_cache=other, token_id=2, token_choice=good),
        pb.DecodeItem(kv_cache=handle, token_id=2, token_choice=bad)]), timeout=30), [item])
    _refused(lambda: stub.BatchPrefill(pb.BatchPrefillRequest(items=[
        pb.PrefillItem(token_ids=[9], kv_cache=other, token_choice=good),
        pb.PrefillItem(token_ids=[5, 6, 7], token_choice=bad)]), timeout=30), [item])
    _refused(lambda: stub.SpeculativeDecode(pb.SpeculativeDecodeRequest(
        kv_cache=handle, token_id=2, draft_token_ids=[4, 5], token_choice=bad), timeout=30), [named])
    (reply,) = stub.DecodeSession(iter([pb.DecodeSessionRequest(step_id=1, items=[
        pb.DecodeItem(kv_cache=other, token_id=2, token_choice=good),
        pb.DecodeItem(kv_cache=handle, token_id=2, token_choice=bad)])]), timeout=30)
    assert reply.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and item in reply.error.message, reply.error

    after = stub.GetStatus(pb.GetStatusRequest(), timeout=30)
    assert (after.active_sequences, after.kv_blocks_used) == (before.active_sequences, before.kv_blocks_used)
    out = stub.Decode(pb.DecodeRequest(kv_cache=handle, token_id=2, logits=pb.LogitsPolicy(kind=pb.LOGITS_KIND_FULL)),
                      timeout=30)
    assert out.kv_cache.sequence_length == 4  # the handle was current: nothing appended
    row = tensor_codec.to_numpy(out.logits.values).reshape(-1)
    assert np.allclose(row, oracle_rows(hf_tiny_llama, [3, 7, 11, 2])[-1], atol=1e-4, rtol=0)
    for h in (out.kv_cache, other):
        stub.ReleaseCache(pb.ReleaseCacheRequest(cache_id=h.cache_id), timeout=30)
