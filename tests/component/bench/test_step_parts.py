"""bench.step_parts: its timers wrap the model's forward, its LM head and the token
choice without changing what a step chooses, and each step's parts add up to it."""

from __future__ import annotations

from bench.step_parts import PARTS, TimedParts
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.types import DecodeInput, TokenChoice


def test_the_parts_of_each_step_add_up_and_the_timers_change_no_choice(tiny_llama_dir):
    config = ExecutorConfig(kv_tokens=128, block_size=4)
    plain = TorchExecutor.from_path("plain", tiny_llama_dir, config)
    timed = TimedParts(TorchExecutor.from_path("timed", tiny_llama_dir, config))
    prompt, greedy = [5, 17, 101, 3, 250, 42], TokenChoice(temperature=0.0)

    first = plain.prefill(prompt, choice=greedy)
    token, handle, want = first.chosen.token_id, first.kv_cache, []
    for _ in range(7):
        out = plain.batch_decode([DecodeInput(token, handle, greedy)], None)[0]
        token, handle = out.chosen.token_id, out.kv_cache
        want.append(token)

    chosen = []
    original = timed.executor.batch_decode

    def recorded(*args, **kwargs):
        outs = original(*args, **kwargs)
        chosen.append(outs[0].chosen.token_id)
        return outs

    timed.executor.batch_decode = recorded
    with timed:
        steps = timed.decode(prompt, 8)
    assert chosen == want  # the same greedy tokens as the untimed executor's
    assert len(steps) == 7 and len(timed.executor.kv) == 0  # the run's sequence released
    for step in steps:
        assert all(step[part] > 0 for part in PARTS)
        assert step["rest"] >= 0 and abs(sum(step[k] for k in (*PARTS, "rest")) - step["step"]) < 1e-6
    assert 0 < timed.head_bytes < timed.weight_bytes
