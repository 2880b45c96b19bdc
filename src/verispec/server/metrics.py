"""Prometheus metrics of one server: latency histograms and token counters observed per request, and the engine's
speculative counters and queue / KV gauges read from `engine.snapshot()` at scrape time (so they are exact).

Every app gets its own `CollectorRegistry`, so several servers (or tests) in one process never share series.
prometheus-client appends `_total` to counter names; the names below are given without it.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

PREFIX = "verispec:"
FINISH_REASONS = ("stop", "length", "abort")

# CPU decoding of small models: first tokens in 10 ms .. minutes under load
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 20.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


class EngineCollector:
    """Reads one engine snapshot per scrape: spec-decode counters, running / waiting requests, KV usage."""

    def __init__(self, snapshot: Callable[[], Any]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        for name, doc, value in (
            ("spec_decode_num_drafts", "Speculative steps that verified at least one draft token.", s.num_drafts),
            ("spec_decode_num_draft_tokens", "Draft tokens verified.", s.num_draft_tokens),
            ("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens),
            ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not prefilled).", s.prefix_cache_hits),
            ("num_preemptions", "Requests preempted when KV blocks ran out (recomputed later).", s.num_preemptions),
            ("engine_steps", "Engine steps that ran a target forward.", s.engine_steps),
            ("engine_forward_tokens", "Rows fed to the target forwards (decode tokens, drafts, prefill chunks).",
             s.forward_tokens),
        ):
            yield CounterMetricFamily(PREFIX + name, doc, value=value)
        phases = CounterMetricFamily(PREFIX + "engine_step_seconds", "Seconds of the engine's steps, by phase: "
                                     "schedule (admission, planning, policy), draft, forward, commit (verification, "
                                     "KV, tokens out).", labels=["phase"])
        for phase, sec in s.step_seconds.items():
            phases.add_metric([phase], sec)
        yield phases
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted, by position in the draft (0 = first).",
                                      labels=["position"])
        for i, n in enumerate(s.accepted_per_pos):
            per_pos.add_metric([str(i)], n)
        yield per_pos
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch.", value=s.num_running)
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests queued for a batch slot.",
                                value=s.num_waiting)
        yield GaugeMetricFamily(PREFIX + "kv_cache_usage_perc", "Fraction of the KV cache's blocks in use (0..1).",
                                value=s.kv_usage)


class ConfigCollector:
    """`verispec:engine_config_info`: constant 1, labelled with what runs (weight path, dtype, quantization,
    device, the speculative method and what a learned drafter's weights run as) and on which CPU (model, kernel
    flags, torch's capability), as vLLM labels its `*_config_info`."""

    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = {k: "none" if v is None else str(v) for k, v in labels.items()}

    def collect(self) -> Iterator[Metric]:
        g = GaugeMetricFamily(PREFIX + "engine_config_info", "The engine's weight path and the CPU it runs on.",
                              labels=list(self.labels))
        g.add_metric(list(self.labels.values()), 1)
        yield g


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], Any], config: dict[str, Any] | None = None) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Request arrival to its first output token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", buckets=TPOT_BUCKETS,
                              registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Request arrival to its last output token.",
                             buckets=E2E_BUCKETS, registry=r)
        self.queue = Histogram(PREFIX + "request_queue_time_seconds", "Request arrival to its admission into the "
                               "running batch (requests that were admitted).", buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Output tokens generated.", registry=r)
        self.request_success = Counter(PREFIX + "request_success", "Finished requests, by finish reason.",
                                       ["finished_reason"], registry=r)
        self.request_errors = Counter(PREFIX + "request_errors", "Requests that failed inside the engine.",
                                      registry=r)
        for reason in FINISH_REASONS:
            self.request_success.labels(reason)
        r.register(EngineCollector(snapshot))
        if config:
            r.register(ConfigCollector(config))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def track(self, arrival: float, prompt_tokens: int) -> "RequestRecord":
        self.prompt_tokens.inc(prompt_tokens)
        return RequestRecord(self, arrival)


class RequestRecord:
    """One admitted request's timings, observed into the histograms once, when it ends."""

    def __init__(self, metrics: ServerMetrics, arrival: float) -> None:
        self.m, self.arrival = metrics, arrival
        self.first: float | None = None
        self.last = arrival
        self.tokens = 0
        self.done = False

    def on_tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self.first is None:
            self.first = now
            self.m.ttft.observe(now - self.arrival)
        self.last, self.tokens = now, self.tokens + n
        self.m.generation_tokens.inc(n)

    def finish(self, reason: str | None, error: bool = False, queue_s: float | None = None) -> None:
        if self.done:
            return
        self.done = True
        if queue_s is not None:
            self.m.queue.observe(queue_s)
        if error:
            self.m.request_errors.inc()
            return
        self.m.request_success.labels(reason or "abort").inc()
        self.m.e2e.observe(time.perf_counter() - self.arrival)
        if self.first is not None and self.tokens > 1:
            self.m.tpot.observe((self.last - self.first) / (self.tokens - 1))
