"""SpeculativeDecode on the executor: the drafts verified in one forward, the kept ones
chosen by greedy, by a sampling rule or by the caller's own token choice, the rest
truncated, all as one worker job (nobody sees the drafts' KV)."""

from __future__ import annotations

from ferrum_rpc.rules import check_drafts
from ferrum_rpc.types import (
    KvCacheHandle,
    LogitsKind,
    LogitsPolicy,
    SpeculativeOutput,
    SpeculativeSampling,
    TokenChoice,
)
from ..choice import speculative
from ..choice.sampling import accept_drafts as choose_drafts
from .undo import Undo


def speculative_decode(ex, token_id: int, draft: list[int], kv_cache: KvCacheHandle,
                       policy: LogitsPolicy | None = LogitsPolicy(),
                       sampling: SpeculativeSampling | None = None, tenant: str = "",
                       choice: TokenChoice | None = None) -> SpeculativeOutput:
    """One round of speculative decoding: ``token_id`` and the drafts in one forward,
    the drafts kept that ``speculative.accept_drafts`` keeps (greedy: the longest
    prefix equal to greedy's choices), the rest truncated, and the logits after
    the kept ones in ``policy``.  With ``choice`` (not with ``sampling``), drafts
    are kept while they equal what the policy chooses (``sampling.accept_drafts``:
    the tokens of Decode steps with that choice) and ``out.chosen`` holds each
    kept draft's choice, then the next token's; ``policy=None``: no logits with a
    choice, else full float32.  Fails with no state change; it is one worker
    job, so nobody sees the drafts' KV."""
    check_drafts(len(draft), choice is not None, sampling is not None, ex.limits)
    if choice is not None:
        ex.check_token_choice(choice)
    want_logits = policy is not None or choice is None
    policy = LogitsPolicy() if policy is None else policy
    ex.checks.policy(policy, 1)
    sampling = speculative.checked_sampling(sampling)
    out = ex.prefill([token_id] + list(draft), kv_cache, LogitsPolicy(LogitsKind.FULL, all_positions=True),
                       tenant=tenant, as_output=True)
    undo = Undo(out.kv_cache.cache_id, kv_cache.sequence_length)  # no left_at: the rejected drafts may be gone
    try:
        rows = out.logits.values  # (1 + len(draft), vocab) float32: row i predicts what follows input i
        seq = ex.kv.get(out.kv_cache.cache_id, tenant)
        chosen: tuple = ()
        if choice is not None:  # the policy's own choices, batched over the rows
            last = kv_cache.sequence_length + 1  # token_id is in: output for the penalties
            split = seq.output_start
            agreed, picks = choose_drafts(rows, draft, choice, last, seq.tokens[:split], seq.tokens[split:last])
            following, chosen = picks[-1].token_id, tuple(picks)
        else:
            agreed, following = speculative.accept_drafts(rows, draft, sampling)
        if agreed < len(draft):  # the rejected drafts' KV goes (their idle clock was restarted by the forward)
            ex.kv.shrink(seq, kv_cache.sequence_length + 1 + agreed)
        logits = ex.apply_policy(rows[agreed:agreed + 1], policy) if want_logits else None
        return SpeculativeOutput(tuple(draft[:agreed]), following, logits, ex.handle(seq), out.timing,
                                 chosen=chosen)
    except BaseException:  # whatever fails after the forward: the sequence is put back as it was
        ex.undo([undo])
        raise
