"""Sampling parameters, and caller-side sampling over the logits the server returns
(numpy only); :meth:`SamplingParams.token_choice` hands the same parameters to the
server instead."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ferrum_rpc.types import Logits, LogitsKind, LogitsPolicy, TokenChoice


@dataclass(frozen=True)
class SamplingParams:
    """greedy wins over everything else; top_k = 0 and top_p = 1 disable those filters."""

    greedy: bool = False
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature <= 0 and not self.greedy:
            raise ValueError("temperature must be > 0 (use greedy for argmax)")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")

    def token_choice(self) -> TokenChoice:
        """The same parameters for the server's sampler (``TokenChoice``): greedy is the
        server's argmax; a seed keys each draw by (seed, position), None draws fresh
        randomness."""
        if self.greedy:
            return TokenChoice.greedy()
        return TokenChoice(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed)

    def logits_policy(self) -> LogitsPolicy:
        """The least the server needs to send for this sampler."""
        if self.greedy:
            return LogitsPolicy.argmax()
        if self.top_k:
            return LogitsPolicy.topk(self.top_k)
        return LogitsPolicy.full()


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: Logits) -> int:
        """Samples a token from the last position of ``logits``."""
        p = self.params
        if p.greedy:
            return logits.argmax()[-1]
        values = np.asarray(logits.values[-1], dtype=np.float64)
        if logits.kind is LogitsKind.FULL:
            ids = np.arange(values.shape[-1])
        else:
            ids = np.asarray(logits.token_ids[-1])
        if p.top_k and values.shape[-1] > p.top_k:
            keep = np.argpartition(-values, p.top_k - 1)[: p.top_k]
            values, ids = values[keep], ids[keep]
        order = np.argsort(-values)
        values, ids = values[order] / p.temperature, ids[order]
        probs = np.exp(values - values.max())
        probs /= probs.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p)) + 1
            probs, ids = probs[:cut] / probs[:cut].sum(), ids[:cut]
        return int(self.rng.choice(ids, p=probs))
