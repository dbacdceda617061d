"""Text generation: tokenize, prefill, choose, decode, detokenize.

The chat template, stopping and detokenizing are the caller's, as in the Ferrum
engine.  The next token is chosen on the server (a ``TokenChoice`` built from the
sampling parameters; the replies carry the chosen token, no logits) where the
server offers it (``Capabilities.token_choice``), else, or with
``server_side=False``, on the caller side from the logits the server returns
(:class:`~ferrum_rpc.client.sampling.Sampler`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ferrum_rpc.client.client import ExecutorClient
from ferrum_rpc.client.sampling import Sampler, SamplingParams
from ferrum_rpc.types import TokenChoice


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def encode_prompt(tokenizer, prompt: str, chat: bool = True) -> list[int]:
    """Token ids of ``prompt``, wrapped in the model's chat template unless ``chat`` is False."""
    if chat and tokenizer.chat_template:
        return list(tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True,
            return_dict=False,
        ))
    return tokenizer.encode(prompt, add_special_tokens=False)


def chooses_on_server(client: ExecutorClient, server_side: bool | None) -> bool:
    """``server_side`` as given, or (None) whether the server offers token choice."""
    if server_side is None:
        return bool(getattr(client.capabilities(), "token_choice", False))
    return server_side


def generate_ids(client: ExecutorClient, prompt_ids: list[int], max_tokens: int,
                 params: SamplingParams, stop_ids: set[int] = frozenset(),
                 server_side: bool | None = None, token_choice: TokenChoice | None = None) -> Iterator[int]:
    """Yields token ids until a stop id or ``max_tokens``; releases the KV at the end.

    ``server_side``: True, the server chooses each token (``params.token_choice()``;
    no logits on the wire); False, the caller samples from the logits the server
    returns; None (the default): the server where its capabilities say it chooses
    tokens.  Greedy gives the same tokens either way; a seed gives the same tokens
    on every run of the same path (the two samplers differ, so not across paths).
    ``token_choice``: the server's policy in full (penalties, logit bias, bitmask)
    instead of the one ``params`` give; it needs the server path."""
    if token_choice is not None and server_side is False:
        raise ValueError("a token_choice is the server's: it needs server_side True or None")
    if token_choice is not None or chooses_on_server(client, server_side):
        choice = token_choice if token_choice is not None else params.token_choice()
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
