"""Speculative decoding on the caller side: draft k tokens, verify them in one
ForwardVerify, keep the longest prefix the target agrees with, roll the target
back with TruncateKv.

Greedy only: the output is token for token what plain greedy decoding gives,
in fewer target forwards when drafts are accepted.  Drafts come from the
context itself (prompt lookup / n-gram) or from a smaller model on the same
server.  Where the server chooses tokens (``Capabilities.token_choice``) the
prefill and SpeculativeDecode carry a greedy ``TokenChoice`` and read the chosen
tokens (no logits on the wire); the same tokens as the argmax of logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from .client import ExecutorClient
from ferrum_rpc.types import KvCacheHandle, LogitsPolicy, TokenChoice

GREEDY = LogitsPolicy.argmax()
GREEDY_CHOICE = TokenChoice.greedy()


class Drafter(Protocol):
    def start(self, prompt_ids: list[int]) -> None: ...
    def draft(self, context: list[int], k: int) -> list[int]: ...
    def accept(self, context: list[int]) -> None: ...
    def close(self) -> None: ...


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n
    tokens (longest n first) and propose the tokens that followed it."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def start(self, prompt_ids: list[int]) -> None:
        pass

    def draft(self, context: list[int], k: int) -> list[int]:
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            tail = context[-n:]
            for i in range(len(context) - n - 1, -1, -1):
                if context[i:i + n] == tail:
                    return context[i + n:i + n + k]
        return []

    def accept(self, context: list[int]) -> None:
        pass

    def close(self) -> None:
        pass


class ModelDrafter:
    """Greedy drafts from a second (smaller) model, kept in step with the target's context."""

    def __init__(self, client: ExecutorClient):
        self.client = client
        self.handle: KvCacheHandle | None = None
        self.next_token = 0

    def start(self, prompt_ids: list[int]) -> None:
        out = self.client.prefill(prompt_ids, logits=GREEDY)
        self.handle, self.next_token = out.kv_cache, out.logits.argmax()[0]

    def draft(self, context: list[int], k: int) -> list[int]:
        # The draft KV holds context[:-1]; feed the last token, then its own guesses.
        tokens, token = [], context[-1]
        for _ in range(k):
            step = self.client.decode(token, self.handle, logits=GREEDY)
            self.handle, token = step.kv_cache, step.logits.argmax()[0]
            tokens.append(token)
        return tokens

    def accept(self, context: list[int]) -> None:
        """Rolls the draft KV back to context[:-1] (the last token is fed next round)."""
        keep = len(context) - 1
        if self.handle.sequence_length > keep:
            self.handle = self.client.truncate_kv(self.handle, keep)
        elif self.handle.sequence_length < keep:  # the target accepted more than was drafted
            missing = context[self.handle.sequence_length:keep]
            self.handle = self.client.prefill(missing, kv_cache=self.handle, logits=GREEDY).kv_cache

    def close(self) -> None:
        if self.handle is not None:
            self.client.release_cache(self.handle)
            self.handle = None


@dataclass
class SpeculativeResult:
    tokens: list[int] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0
    target_forwards: int = 0
    seconds: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


def speculative_generate(client: ExecutorClient, prompt_ids: list[int], max_tokens: int, k: int = 4,
                         drafter: Drafter | None = None, stop_ids: frozenset[int] = frozenset(),
                         server_side: bool | None = None, token_choice: bool | None = None) -> SpeculativeResult:
    """Greedy generation of up to ``max_tokens`` tokens with drafts verified in one forward each.

    Args:
        client: the target model's client.
        prompt_ids: the prompt.
        max_tokens: most tokens to produce (stops early after a stop id).
        k: tokens drafted per round.
        drafter: where drafts come from (default: :class:`NgramDrafter`).
        stop_ids: ids that end generation (kept in the output).
        server_side: one SpeculativeDecode call a round (verify, accept and truncate
            on the server) instead of ForwardVerify + TruncateKv; None: where the
            server's capabilities say it has it.
        token_choice: the server chooses the tokens (a greedy ``TokenChoice``: the prefill's
            and each SpeculativeDecode's ``chosen``, no logits on the wire) instead of the
            caller taking the argmax of returned logits; None: where the server's
            capabilities say it chooses tokens.  The same tokens either way.  (The
            ForwardVerify path always reads argmax logits.)

    Returns:
        The tokens plus drafted/accepted counts and the number of target forwards.
    """
    drafter = drafter or NgramDrafter()
    caps = client.capabilities() if server_side is None or token_choice is None else None
    if server_side is None:
        server_side = caps.speculative_decode
    if token_choice is None:
        token_choice = bool(getattr(caps, "token_choice", False))
    result = SpeculativeResult()
    start = time.perf_counter()
    if token_choice:
        out = client.prefill(prompt_ids, token_choice=GREEDY_CHOICE)
        handle, generated = out.kv_cache, [out.chosen.token_id]
    else:
        out = client.prefill(prompt_ids, logits=GREEDY)
        handle, generated = out.kv_cache, [out.logits.argmax()[0]]
    result.target_forwards = 1
    drafter.start(prompt_ids)
    try:
        while len(generated) < max_tokens and generated[-1] not in stop_ids:
            context = prompt_ids + generated
            draft = drafter.draft(context, min(k, max_tokens - len(generated) - 1))
            if server_side and token_choice:  # one round trip; the server's greedy choice, no logits
                spec = client.speculative_decode(generated[-1], draft, handle, token_choice=GREEDY_CHOICE)
                handle, agreed, following = spec.kv_cache, len(spec.accepted_token_ids), spec.chosen[-1].token_id
            elif server_side:  # one round trip: the server verifies, accepts and truncates
                spec = client.speculative_decode(generated[-1], draft, handle, logits=GREEDY)
                handle, agreed, following = spec.kv_cache, len(spec.accepted_token_ids), spec.next_token_id
            else:
                base = handle.sequence_length  # the KV holds context[:-1]
                verify = client.forward_verify([generated[-1]] + draft, handle, logits=GREEDY)
                predicted = verify.logits.argmax()  # predicted[i] follows input i
                agreed = 0
                while agreed < len(draft) and draft[agreed] == predicted[agreed]:
                    agreed += 1
                handle, following = verify.kv_cache, predicted[agreed]
                if agreed < len(draft):  # drop the rejected drafts' KV
                    handle = client.truncate_kv(handle, base + 1 + agreed)
            result.target_forwards += 1
            result.drafted += len(draft)
            result.accepted += agreed
            for token in draft[:agreed] + [following]:
                generated.append(token)
                if token in stop_ids or len(generated) == max_tokens:
                    break
            drafter.accept(prompt_ids + generated)
    finally:
        client.release_cache(handle)
        drafter.close()
    result.tokens = generated
    result.seconds = time.perf_counter() - start
    return result
