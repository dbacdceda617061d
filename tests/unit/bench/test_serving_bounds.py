"""bench.serving's verdicts: what "holds a rate" means, from the figures of each run."""

from bench.serving import Request, highest_held, summarise


def run(rate: float, mode: str, ttft_s: float, gap_s: float, n: int = 4, failed: int = 0) -> dict:
    """A run of ``n`` requests, each first token ``ttft_s`` after its arrival and the
    rest ``gap_s`` apart (``failed`` of them ending in an error)."""
    requests = []
    for i in range(n):
        r = Request(arrival=10.0 * i)
        r.times = [r.arrival + ttft_s + gap_s * k for k in range(8)]
        r.error = "StatusCode.UNAVAILABLE" if i < failed else ""
        requests.append(r)
    return summarise(requests, rate, mode)


def test_both_bounds_are_needed_to_hold():
    assert run(1.0, "poisson", 0.5, 0.05)["holds"]
    slow_first = run(1.0, "poisson", 2.5, 0.05)
    assert not slow_first["holds"] and slow_first["holds_itl"]
    stalls = run(1.0, "poisson", 0.5, 0.3)
    assert not stalls["holds"] and not stalls["holds_itl"]
    assert not run(1.0, "poisson", 0.5, 0.05, failed=1)["holds_itl"]


def test_highest_rate_stops_at_the_first_miss():
    rows = [run(0.5, "poisson", 0.5, 0.05), run(1.0, "poisson", 0.5, 0.05),
            run(2.0, "poisson", 3.0, 0.05), run(3.0, "poisson", 0.5, 0.05), run(0.0, "burst", 9.0, 0.5)]
    assert highest_held(rows) == 1.0  # 3.0 holding again after a miss does not count
    assert highest_held(rows, "holds_itl") == 3.0  # the burst is no rate


def test_a_server_whose_lone_requests_miss_holds_no_rate():
    rows = [run(0.0, "alone", 3.5, 0.03), run(0.25, "poisson", 1.5, 0.03)]
    assert highest_held(rows) == 0.0
    assert highest_held(rows, "holds_itl") == 0.25


def test_alone_requests_on_their_own_clocks_add_their_spans():
    """ferrum-engine-load times each lone request from its own run's start (arrival 0)."""
    requests = []
    for _ in range(3):
        r = Request(arrival=0.0)
        r.times = [0.5 + 0.1 * k for k in range(10)]  # 10 tokens in 1.4 s
        requests.append(r)
    assert abs(summarise(requests, 0.0, "alone")["output_tokens_per_s"] - 30 / 4.2) < 1e-9
