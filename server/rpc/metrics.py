"""Prometheus metrics on ``--metrics-port`` (prometheus-client's own exposition).

Per call, counted by the servicer: requests by RPC, status code and tenant;
latency histograms of the whole call, its queue wait and its forward.  Read
from the executors at scrape time (no bookkeeping on the hot path): forwards
by batch size, tokens processed, KV blocks used/free/shared/cached, prefix
cache queried/hit tokens, sequences alive (per tenant) and expired, on a
tensor-parallel server the bytes its LM head gathered, and the
transfers running (imports, the KV bytes they buffer and their budget, pushes).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

log = logging.getLogger(__name__)

_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The registry of one server process; ``executors`` lists the hosted executors."""

    def __init__(self, executors: Callable[[], Iterable], transfers: Callable[[], dict] | None = None):
        self.registry = CollectorRegistry()
        labels = ["method", "code", "tenant"]
        self.requests = Counter("ferrum_requests", "RPCs answered, by method, status code and tenant", labels,
                                registry=self.registry)
        self.latency = Histogram("ferrum_request_seconds", "Whole-call latency as the server saw it", ["method"],
                                 buckets=_SECONDS, registry=self.registry)
        self.queue = Histogram("ferrum_queue_seconds", "Time a call's work waited for the model worker",
                               ["method"], buckets=_SECONDS, registry=self.registry)
        self.forward = Histogram("ferrum_forward_seconds", "Forward (model + LM head) time of a call's result",
                                 ["method"], buckets=_SECONDS, registry=self.registry)
        self.registry.register(_ExecutorCollector(executors))
        if transfers is not None:
            self.registry.register(_TransferCollector(transfers))

    def observe(self, method: str, code: str, tenant: str, seconds: float, timing=None) -> None:
        self.requests.labels(method, code, tenant).inc()
        self.latency.labels(method).observe(seconds)
        if timing is not None:
            self.queue.labels(method).observe(timing.queue_ns / 1e9)
            self.forward.labels(method).observe(timing.forward_ns / 1e9)

    def serve(self, port: int, host: str) -> int:
        """Starts the HTTP exposition; returns the bound port (0 picks one)."""
        server, _ = start_http_server(port, addr=host, registry=self.registry)
        bound = server.server_address[1]
        log.info("metrics on http://%s:%d/metrics", host, bound)
        return bound


class _ExecutorCollector:
    """Reads each executor's counters when scraped (reads only; the worker thread owns them)."""

    def __init__(self, executors: Callable[[], Iterable]):
        self.executors = executors

    def collect(self):
        gauges = {name: GaugeMetricFamily(f"ferrum_kv_blocks_{name}", f"KV blocks {name}", labels=["model"])
                  for name in ("used", "free", "shared", "cached")}
        alive = GaugeMetricFamily("ferrum_sequences_alive", "Live sequences", labels=["model", "tenant"])
        expired = CounterMetricFamily("ferrum_sequences_expired", "Sequences reclaimed idle", labels=["model"])
        tokens = CounterMetricFamily("ferrum_tokens_processed", "Tokens run through forwards", labels=["model"])
        queried = CounterMetricFamily("ferrum_prefix_cache_queried_tokens", "Prompt tokens looked up",
                                      labels=["model"])
        hits = CounterMetricFamily("ferrum_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                   labels=["model"])
        batches = HistogramMetricFamily("ferrum_forward_batch_size", "Sequences per forward", labels=["model"])
        bursts = CounterMetricFamily("ferrum_burst_forwards", "Decode-ahead forwards run in bursts (runs alone "
                                     "on the worker)", labels=["model"])
        split = {  # tensor parallel only: what the vocabulary-parallel LM head sent to rank 0
            "forwards": CounterMetricFamily("ferrum_tensor_parallel_forwards", "Forwards run on every rank",
                                            labels=["model"]),
            "lm_head_bytes": CounterMetricFamily(
                "ferrum_tensor_parallel_lm_head_bytes", "Bytes the LM head's reductions and token choice "
                "gathered to rank 0 from the other ranks", labels=["model"]),
            "choice_fallback_rows": CounterMetricFamily(
                "ferrum_tensor_parallel_choice_fallback_rows", "Token-choice rows that gathered whole rows",
                labels=["model"]),
        }
        for ex in self.executors():
            kv, model = ex.kv, [ex.name]
            gauges["used"].add_metric(model, kv.num_used)
            gauges["free"].add_metric(model, kv.num_free)
            gauges["shared"].add_metric(model, kv.num_shared)
            gauges["cached"].add_metric(model, kv.num_cached_free)
            per_tenant: dict[str, int] = {}
            for seq in kv.sequences():
                per_tenant[seq.tenant] = per_tenant.get(seq.tenant, 0) + 1
            for tenant, n in sorted(per_tenant.items()):
                alive.add_metric([ex.name, tenant], n)
            expired.add_metric(model, kv.expired_count)
            tokens.add_metric(model, ex.stats.tokens_processed)
            queried.add_metric(model, kv.queried_tokens)
            hits.add_metric(model, kv.hit_tokens)
            sizes = dict(ex.stats.batch_sizes)
            buckets = [(str(bound), sum(n for size, n in sizes.items() if size <= bound)) for bound in BATCH_BUCKETS]
            buckets.append(("+Inf", sum(sizes.values())))
            batches.add_metric(model, buckets, sum(size * n for size, n in sizes.items()))
            bursts.add_metric(model, ex.stats.burst_forwards)
            if (runner := getattr(ex, "runner", None)) is not None:
                split["forwards"].add_metric(model, runner.forwards)
                split["lm_head_bytes"].add_metric(model, runner.shard.lm_head_bytes)
                split["choice_fallback_rows"].add_metric(model, runner.shard.choice_fallback_rows)
        yield from (*gauges.values(), alive, expired, tokens, queried, hits, batches, bursts, *split.values())


class _TransferCollector:
    """The server's transfers when scraped (``TransferRpcs.transfer_figures``)."""

    HELP = {
        "imports_in_flight": "ImportSequence calls running",
        "transfer_bytes_in_flight": "KV bytes imports in flight buffer",
        "transfer_budget_bytes": "The most KV bytes imports in flight may buffer (--transfer-budget-mb)",
        "pushes_in_flight": "PushSequence calls running",
    }

    def __init__(self, figures: Callable[[], dict]):
        self.figures = figures

    def collect(self):
        for name, value in self.figures().items():
            yield GaugeMetricFamily(f"ferrum_{name}", self.HELP[name], value=value)
