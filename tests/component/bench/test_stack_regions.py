"""bench.stack_regions: its decode and prompt runs leave no sequence behind, and the
two paths it compares (the stack's one region, a layer_step a layer) choose the same
greedy tokens for a batch past the region's old four-row limit."""

from __future__ import annotations

from bench.stack_regions import decode_ms, prompt_ms
from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor


def test_region_and_layer_steps_choose_the_same_tokens_and_release_their_sequences(tiny_llama_dir):
    ex = TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=1024, block_size=4))
    stack = ex.model.layer_ops
    assert stack is not None and stack.panels_region()
    chosen = {}
    for regions in (False, True):
        stack.set_regions(regions)
        ms, chosen[regions] = decode_ms(ex, 6, 5, seed=3)
        assert ms > 0 and len(chosen[regions]) == 5 and all(len(step) == 6 for step in chosen[regions])
        assert prompt_ms(ex, 40, seed=3) > 0
        assert len(ex.kv) == 0
    stack.set_regions(True)
    assert chosen[False] == chosen[True]
