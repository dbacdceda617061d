"""The blocking client runs a server-streaming call (BatchDecode, BatchPrefill) on the
calling thread.  grpc's default drives such calls from a thread it starts whenever a
channel has no call in flight: a thread for each step of a caller decoding one sequence,
time every step paid."""

from __future__ import annotations

import threading

from ferrum_rpc.types import DecodeInput, LogitsPolicy

GREEDY = LogitsPolicy.argmax()


def test_decode_steps_and_a_batch_prefill_start_no_thread(client, monkeypatch):
    out = client.prefill([5, 6, 7, 8], logits=GREEDY)
    handle = client.batch_decode([DecodeInput(9, out.kv_cache)], GREEDY)[0].kv_cache  # anything lazy starts here
    started = []
    start = threading.Thread.start

    def counted(thread, *args, **kwargs):
        started.append(thread.name)
        return start(thread, *args, **kwargs)

    monkeypatch.setattr(threading.Thread, "start", counted)
    for token in (10, 11, 12):
        step = client.batch_decode([DecodeInput(token, handle)], GREEDY)[0]
        assert step.kv_cache.sequence_length == handle.sequence_length + 1
        handle = step.kv_cache
    prompts = client.batch_prefill([[1, 2, 3], [4, 5]], GREEDY)
    monkeypatch.undo()
    assert started == []
    for h in (handle, *(p.kv_cache for p in prompts)):
        client.release_cache(h.cache_id)
