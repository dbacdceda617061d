"""bench.decode_throughput's rounds: every system (and the anchor first) once a round, and
each row's ratios to the anchor taken round by round."""

from __future__ import annotations

from bench import decode_throughput as dt


def test_systems_take_turns_after_the_anchor_and_keep_their_own_prefill_times(monkeypatch):
    order, prefill = [], []
    monkeypatch.setattr(dt, "PREFILL_SECONDS", prefill)

    def runner(name, seconds, prefill_s):
        def run(prompts):
            order.append(name)
            if prefill_s is not None:
                prefill.append(prefill_s)
            return seconds
        return run

    anchor_times = iter([(4.0, 1.0), (8.0, 2.0), (4.0, 1.0)])
    runners = {"a": runner("a", 2.0, 0.5), "b": runner("b", 1.0, None)}  # b records no prefill
    gbs = iter([10.0, 20.0, 40.0])
    runs, prefills, beside, probes = dt.decode_turns(
        runners, [[1]], 3, lambda: order.append("anchor") or next(anchor_times), lambda: order.append("probe") or next(gbs))
    assert order == ["probe", "anchor", "a", "b"] * 3 and probes == [10.0, 20.0, 40.0]
    assert runs == {"a": [2.0] * 3, "b": [1.0] * 3}
    assert prefills == {"a": [0.5] * 3, "b": [0.0] * 3}
    # round ratios 2, 4, 2 end to end; decode-only (4-1)/(2-0.5) = 2, (8-2)/1.5 = 4
    assert dt.per_round_vs(runs["a"], prefills["a"], beside) == {"llama.cpp": 2.0, "llama.cpp_decode": 2.0,
                                                                 "rounds": 3}
    # 3 steps of 0.5 s each against 1e9 bytes at 10, 20, 40 GB/s (0.1, 0.05, 0.025 s): 5x, 10x, 20x
    assert dt.per_round_floor(runs["a"], prefills["a"], probes, 10**9, 3) == {
        "step_vs_weight_reads": 10.0, "bandwidth_gbs": [10.0, 20.0, 40.0], "rounds": 3}
    assert dt.decode_turns(runners, [[1]], 2, lambda: None)[2:] == ([], [])  # no anchor, no probe: none beside
