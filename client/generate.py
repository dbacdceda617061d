"""Text generation: tokenize, prefill, choose, decode, detokenize.

The chat template, stopping and detokenizing are the caller's, as in the Ferrum
engine.  The next token is chosen on the server (a ``TokenChoice`` built from the
sampling parameters; the replies carry the chosen token, no logits) where the
server offers it (``Capabilities.token_choice``), else, or with
``server_side=False``, on the caller side from the logits the server returns
(:class:`~ferrum_rpc.client.sampling.Sampler`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

from .client import ExecutorClient
from ferrum_rpc.errors import ExecutorError
from .sampling import Sampler, SamplingParams
from ferrum_rpc.types import DecodeInput, TokenChoice
from .text import load_tokenizer  # noqa: F401  (the tokenizer callers of this module load)


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``, wrapped in the model's chat template unless ``chat`` is False
    (``tokenizer``: :func:`~ferrum_rpc.client.text.load_tokenizer`'s)."""
    if chat and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True))
    return tokenizer.encode(prompt, add_special_tokens=False)


def chooses_on_server(client: ExecutorClient, server_side: bool | None) -> bool:
    """``server_side`` as given, or (None) whether the server offers token choice."""
    if server_side is None:
        return bool(getattr(client.capabilities(), "token_choice", False))
    return server_side


def decodes_ahead(client, max_tokens: int, ahead: bool | None) -> bool:
    """``ahead`` as given, or (None) whether ``client`` is one server's client whose
    server decodes ahead as far as ``max_tokens`` asks (replica sets decode step by
    step: each step is what their failover replays)."""
    if ahead is not None:
        return ahead
    return isinstance(client, ExecutorClient) and client.capabilities().max_decode_ahead >= max_tokens - 1


def generate_ids(client: ExecutorClient, prompt_ids: list[int], max_tokens: int,
                 params: SamplingParams, stop_ids: set[int] = frozenset(),
                 server_side: bool | None = None, token_choice: TokenChoice | None = None,
                 ahead: bool | None = None) -> Iterator[int]:
    """Yields token ids until a stop id or ``max_tokens``; releases the KV at the end.

    ``server_side``: True, the server chooses each token (``params.token_choice()``;
    no logits on the wire); False, the caller samples from the logits the server
    returns; None (the default): the server where its capabilities say it chooses
    tokens.  Greedy gives the same tokens either way; a seed gives the same tokens
    on every run of the same path (the two samplers differ, so not across paths).
    ``token_choice``: the server's policy in full (penalties, logit bias, bitmask)
    instead of the one ``params`` give; it needs the server path.
    ``ahead`` (server path only): True, after the prompt the server decodes on its
    own and streams the tokens (one DecodeSession step, no round trip per token;
    the same tokens as step by step); False, one Decode call per token; None: ahead
    where :func:`decodes_ahead` says it can."""
    if token_choice is not None and server_side is False:
        raise ValueError("a token_choice is the server's: it needs server_side True or None")
    if token_choice is not None or chooses_on_server(client, server_side):
        choice = token_choice if token_choice is not None else params.token_choice()
        if decodes_ahead(client, max_tokens, ahead):
            yield from _generate_ahead(client, prompt_ids, max_tokens, stop_ids, choice)
            return
        yield from _generate(client, prompt_ids, max_tokens, stop_ids, {"token_choice": choice},
                             lambda reply: reply.chosen.token_id)
        return
    sample = Sampler(params)
    yield from _generate(client, prompt_ids, max_tokens, stop_ids, {"logits": params.logits_policy()},
                         lambda reply: sample(reply.logits))


def _generate(client: ExecutorClient, prompt_ids: list[int], max_tokens: int, stop_ids: set[int],
              ask: dict, pick) -> Iterator[int]:
    """Prefill, then decode each token ``pick`` takes from the last reply (the server's
    ``chosen`` token, or one sampled from its logits); ``ask``: what each call asks for."""
    out = client.prefill(prompt_ids, **ask)
    handle = out.kv_cache
    try:
        token = pick(out)
        for produced in range(max_tokens):
            yield token
            if token in stop_ids or produced + 1 == max_tokens:
                break
            step = client.decode(token, handle, **ask)
            handle = step.kv_cache
            token = pick(step)
    finally:
        client.release_cache(handle)


def _generate_ahead(client: ExecutorClient, prompt_ids: list[int], max_tokens: int, stop_ids: set[int],
                    choice: TokenChoice) -> Iterator[int]:
    """Prefill with the choice, then one decode-ahead step for the rest.  A caller that
    stops reading early stops the run (the server ends it after its current forward)."""
    out = client.prefill(prompt_ids, token_choice=choice)
    try:
        token = out.chosen.token_id
        yield token
        if token in stop_ids or max_tokens <= 1:
            return
        with client.decode_session() as session:
            run = session.decode_ahead([DecodeInput(token, out.kv_cache, choice)], max_tokens - 1,
                                       stop_token_ids=sorted(stop_ids))
            try:
                for _, chosen in run:
                    yield chosen.token_id
            finally:
                if not run.finished:  # the caller stopped reading: end the run before the release
                    run.stop()
                    with contextlib.suppress(ExecutorError):
                        run.wait()
    finally:
        client.release_cache(out.kv_cache)  # by its id: whatever length the run left it at


def stream_text(tokenizer, ids: Iterator[int], stop_ids: set[int]) -> Iterator[str]:
    """Turns a stream of ids into text deltas, decoding each token once.

    The tokenizers library's incremental decoder (``DecodeStream``) holds back
    bytes that do not yet form a whole UTF-8 character and yields text as soon
    as they do, so a delta never splits a character and the work per token does
    not grow with the output.  A tokenizer without a fast backend falls back to
    re-decoding the tail."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        yield from _stream_by_redecoding(tokenizer, ids, stop_ids)
        return
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    for token in ids:
        if token in stop_ids:
            break
        delta = stream.step(backend, token)
        if delta:
            yield delta


def _stream_by_redecoding(tokenizer, ids: Iterator[int], stop_ids: set[int]) -> Iterator[str]:
    produced: list[int] = []
    shown = ""
    for token in ids:
        if token in stop_ids:
            break
        produced.append(token)
        text = tokenizer.decode(produced, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            yield text[len(shown):]
            shown = text
