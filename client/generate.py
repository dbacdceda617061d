"""Text generation on the caller side: tokenize, prefill, sample, decode, detokenize.

The server only runs forwards; everything here (chat template, sampling,
stopping) is the caller's, as in the Ferrum engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

from ferrum_rpc.client.client import ExecutorClient
from ferrum_rpc.client.sampling import Sampler, SamplingParams


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


def generate_ids(client: ExecutorClient, prompt_ids: list[int], max_tokens: int,
                 params: SamplingParams, stop_ids: set[int] = frozenset()) -> Iterator[int]:
    """Yields sampled token ids until a stop id or ``max_tokens``; releases the KV at the end."""
    sample = Sampler(params)
    policy = params.logits_policy()
    out = client.prefill(prompt_ids, logits=policy)
    handle = out.kv_cache
    try:
        token = sample(out.logits)
        for produced in range(max_tokens):
            yield token
            if token in stop_ids or produced + 1 == max_tokens:
                break
            step = client.decode(token, handle, logits=policy)
            handle = step.kv_cache
            token = sample(step.logits)
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
