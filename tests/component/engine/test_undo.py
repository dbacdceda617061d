"""The one undo record (``executor.Undo``) and the one way to apply it
(``TorchExecutor.undo``): what a finished call's record puts back, and what it
leaves alone."""

from __future__ import annotations

import pytest

from ferrum_rpc.server.config import ExecutorConfig
from ferrum_rpc.server.engine.executor import TorchExecutor
from ferrum_rpc.server.engine.undo import Undo
from ferrum_rpc.types import LogitsPolicy
from tests.conftest import executor_snapshot as snapshot

GREEDY = LogitsPolicy.argmax()


@pytest.fixture
def ex(tiny_llama_dir):
    return TorchExecutor.from_path("tiny", tiny_llama_dir, ExecutorConfig(kv_tokens=256, block_size=4))


def test_a_record_releases_what_its_call_created_and_applying_it_twice_is_harmless(ex):
    before = snapshot(ex)
    out = ex.prefill([1, 2, 3, 4, 5], None, GREEDY)
    undo = Undo.of(None, out.kv_cache)
    assert (undo.back_to, undo.left_at) == (None, 5)
    ex.undo([undo])
    ex.undo([undo])
    assert snapshot(ex) == before


def test_a_record_truncates_back_unless_something_moved_the_sequence_since(ex):
    first = ex.prefill([1, 2, 3, 4, 5], None, GREEDY).kv_cache
    decoded = ex.decode(6, first).kv_cache
    moved = ex.decode(7, decoded).kv_cache  # a later call moved it on: the first decode's record is stale
    ex.undo([Undo.of(first, decoded)])
    assert ex.kv.get(first.cache_id).length == moved.sequence_length
    ex.undo([Undo.of(decoded, moved)])
    assert ex.kv.get(first.cache_id).length == decoded.sequence_length
    ex.undo([Undo(first.cache_id, 3)])  # no left_at: truncated back whatever the length
    assert ex.kv.get(first.cache_id).length == 3


def test_a_record_of_a_sequence_already_gone_is_skipped(ex):
    out = ex.prefill([1, 2, 3], None, GREEDY).kv_cache
    ex.release_cache(out.cache_id)
    ex.undo([Undo.of(None, out), Undo(out.cache_id, 1)])
    assert len(ex.kv) == 0


def test_a_record_is_skipped_once_a_later_call_changed_the_sequence_back_to_its_length(ex):
    """Cut back and grown again to the very length the recorded call left: the length
    matches, but the tokens are another call's, so the record must not apply (a session
    whose stream broke is abandoned after its caller already redid the step elsewhere)."""
    first = ex.prefill([1, 2, 3, 4, 5], None, GREEDY).kv_cache
    decoded = ex.decode(6, first).kv_cache
    cut = ex.truncate_kv(decoded, 5)
    redone = ex.decode(9, cut).kv_cache
    assert redone.sequence_length == decoded.sequence_length
    ex.undo([Undo.of(first, decoded)])
    seq = ex.kv.get(first.cache_id)
    assert (seq.length, seq.tokens[-1]) == (6, 9)
    ex.undo([Undo.of(cut, redone)])  # the latest change's own record still applies
    assert ex.kv.get(first.cache_id).length == 5
