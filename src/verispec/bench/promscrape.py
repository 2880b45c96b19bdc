"""Speculative-decoding counters from a server's Prometheus /metrics, and their deltas over a benchmark level.

Four name families are read (parsed with prometheus-client's own text parser; series with other labels, e.g.
vLLM's `engine` / `model_name`, are summed):

- verispec (ours, `verispec.server.metrics`): counters `verispec:spec_decode_num_drafts_total`,
  `verispec:spec_decode_num_draft_tokens_total`, `verispec:spec_decode_num_accepted_tokens_total`,
  `verispec:spec_decode_num_accepted_tokens_per_pos_total{position}`.
- vLLM (v1 engine): the same counters under `vllm:`.
- llama.cpp's llama-server (started with --metrics): the same counters under `llamacpp:` (its
  tools/server/server-task.cpp; drafts = verification steps with a non-empty draft, as ours).
- SGLang: no counters, two gauges set by the scheduler at each of its log intervals over the recent batches,
  `sglang:spec_accept_length` (mean acceptance length, bonus token included) and `sglang:spec_accept_rate`
  (accepted / drafted). Names as in SGLang's `python/sglang/srt/metrics/collector.py`. A gauge has no delta: a
  level reports the value read at its end (and the mean of values sampled during it, where the sweep sampled).

Prefix caching: `verispec:` / `vllm:` `prefix_cache_queries_total` and `prefix_cache_hits_total` (prompt tokens
looked up / found cached; vLLM V1's names): a level's deltas give its prefix-cache hit rate.

verispec also exports its step clock (`verispec:engine_steps_total`, `verispec:engine_forward_tokens_total`,
`verispec:engine_step_seconds_total{phase}`): a level's deltas give its steps, rows per step and ms per step by
phase.

Definitions (docs/measuring.md): tau (mean acceptance length) = 1 + accepted / drafts, where drafts = verification steps
that checked at least one draft token; acceptance rate = accepted / draft tokens; per-position acceptance =
accepted at position i / drafts (vLLM's convention: the share of steps whose draft was accepted up to i).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

FAMILIES = ("verispec", "vllm", "llamacpp")
COUNTERS = {"drafts": "spec_decode_num_drafts", "draft_tokens": "spec_decode_num_draft_tokens",
            "accepted": "spec_decode_num_accepted_tokens"}
PER_POS = "spec_decode_num_accepted_tokens_per_pos"
SGLANG_GAUGES = {"accept_length": "sglang:spec_accept_length", "accept_rate": "sglang:spec_accept_rate"}
CONFIG_INFO = "verispec:engine_config_info"  # which weight path ran, on which CPU (labels)
BUSY_GAUGES = {"verispec:num_requests_running", "verispec:num_requests_waiting", "vllm:num_requests_running",
               "vllm:num_requests_waiting", "sglang:num_running_reqs", "sglang:num_queue_reqs"}
QUEUE_HISTOGRAMS = {"verispec:request_queue_time_seconds", "vllm:request_queue_time_seconds"}  # arrival -> admission
STEPS, STEP_SECONDS, FORWARD_TOKENS = "verispec:engine_steps", "verispec:engine_step_seconds", \
    "verispec:engine_forward_tokens"  # verispec's step clock (engine/counters.py)
PREFIX_COUNTERS = {"queries": "prefix_cache_queries", "hits": "prefix_cache_hits"}  # prompt tokens, in FAMILIES


@dataclass
class SpecSnapshot:
    """One scrape's spec-decode values. `family` is None when the server exposes none of the known names."""

    family: str | None = None
    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    per_pos: dict[int, float] = field(default_factory=dict)
    gauges: dict[str, float] = field(default_factory=dict)  # SGLang's accept_length / accept_rate
    busy: float | None = None  # requests running + waiting, where the server exports them
    config: dict[str, str] = field(default_factory=dict)  # verispec's engine_config_info labels: path, CPU flags
    queue: tuple[float, float] | None = None  # (sum of seconds, count) of the queue-time histogram, where exported
    steps: dict[str, float] = field(default_factory=dict)  # verispec: "steps", "tokens" and seconds per phase
    prefix: dict[str, float] = field(default_factory=dict)  # prefix-cache "queries" / "hits" (tokens), if exported


def _counter_name(sample_name: str) -> str:
    return sample_name[:-6] if sample_name.endswith("_total") else sample_name


def parse_spec_metrics(text: str) -> SpecSnapshot:
    """Read the spec-decode values of one /metrics text (any of the known families; the first found wins, in the
    order verispec, vLLM, llama.cpp, SGLang)."""
    found: dict[str, SpecSnapshot] = {f: SpecSnapshot(family=f) for f in (*FAMILIES, "sglang")}
    seen: set[str] = set()
    gauge_n: dict[str, int] = {}
    busy: float | None = None
    config: dict[str, str] = {}
    queue = [0.0, 0.0, False]  # sum, count, seen
    steps: dict[str, float] = {}
    cache_counts: dict[str, dict[str, float]] = {}  # family -> prefix-cache "queries" / "hits"
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == CONFIG_INFO:
                config = dict(s.labels)
            base, _, part = s.name.rpartition("_")
            if base in QUEUE_HISTOGRAMS and part in ("sum", "count"):
                queue[part == "count"] += s.value
                queue[2] = True
            if s.name in BUSY_GAUGES:
                busy = (busy or 0.0) + s.value
            name = _counter_name(s.name)
            if name in (STEPS, FORWARD_TOKENS):
                steps["steps" if name == STEPS else "tokens"] = s.value
            elif name == STEP_SECONDS and "phase" in s.labels:
                steps[s.labels["phase"]] = s.value
            prefix, _, short = name.partition(":")
            if prefix in FAMILIES:
                for key, metric in PREFIX_COUNTERS.items():
                    if short == metric:
                        cache_counts.setdefault(prefix, dict.fromkeys(PREFIX_COUNTERS, 0.0))[key] += s.value
                snap = found[prefix]
                for key, metric in COUNTERS.items():
                    if short == metric:
                        setattr(snap, key, getattr(snap, key) + s.value)
                        seen.add(prefix)
                if short == PER_POS and "position" in s.labels:
                    pos = int(s.labels["position"])
                    snap.per_pos[pos] = snap.per_pos.get(pos, 0.0) + s.value
                    seen.add(prefix)
            for key, metric in SGLANG_GAUGES.items():
                if s.name == metric and not math.isnan(s.value):
                    g = found["sglang"].gauges
                    g[key] = g.get(key, 0.0) + s.value  # averaged over series (ranks) below
                    gauge_n[key] = gauge_n.get(key, 0) + 1
                    seen.add("sglang")
    for key, n in gauge_n.items():
        found["sglang"].gauges[key] /= n
    q = (queue[0], queue[1]) if queue[2] else None
    cached = next((cache_counts[f] for f in FAMILIES if f in cache_counts), {})
    for f in (*FAMILIES, "sglang"):
        if f in seen:
            found[f].busy, found[f].config, found[f].queue, found[f].steps = busy, config, q, steps
            found[f].prefix = cached
            return found[f]
    return SpecSnapshot(busy=busy, config=config, queue=q, steps=steps, prefix=cached)


def spec_delta(before: SpecSnapshot | None, after: SpecSnapshot | None,
               gauge_samples: list[SpecSnapshot] | None = None) -> dict[str, Any]:
    """Counters after - before, with acceptance rate, tau and per-position acceptance. NaN where unknown
    (no /metrics, no known names, a gauge-only family, or a counter that went backwards: a restarted server)."""
    nan = float("nan")
    out: dict[str, Any] = {"spec_source": "none", "drafts": nan, "draft_tokens": nan, "accepted": nan,
                           "acceptance_rate": nan, "tau": nan, "per_pos_accepted": [], "per_pos_acceptance": []}
    if after is not None and after.config:
        out["engine_config"] = dict(after.config)
    if before is not None and after is not None and before.queue and after.queue:
        n = after.queue[1] - before.queue[1]
        out["queue_mean_s"] = (after.queue[0] - before.queue[0]) / n if n > 0 else nan
        out["queued_requests"] = n
    if before is not None and after is not None:
        out.update(_step_delta(before.steps, after.steps))
        out.update(_prefix_delta(before.prefix, after.prefix))
    if before is None or after is None or after.family is None:
        return out
    out["spec_source"] = after.family
    if after.family == "sglang":
        length, rate = after.gauges.get("accept_length", nan), after.gauges.get("accept_rate", nan)
        out.update(tau=length, acceptance_rate=rate, spec_source="sglang gauges (value at level end)")
        samples = [s.gauges["accept_length"] for s in gauge_samples or [] if s.gauges.get("accept_length", 0) > 0]
        if samples:
            out["tau_sampled_mean"] = sum(samples) / len(samples)
        return out
    if before.family not in (None, after.family):
        return out
    d = {k: getattr(after, k) - getattr(before, k) for k in COUNTERS}
    if any(v < 0 for v in d.values()):
        out["spec_source"] = f"{after.family} (counters went backwards: server restarted?)"
        return out
    out.update(d)
    out["acceptance_rate"] = d["accepted"] / d["draft_tokens"] if d["draft_tokens"] else nan
    out["tau"] = 1 + d["accepted"] / d["drafts"] if d["drafts"] else nan
    n = max(after.per_pos, default=-1) + 1
    per = [after.per_pos.get(i, 0.0) - before.per_pos.get(i, 0.0) for i in range(n)]
    while per and per[-1] == 0:
        per.pop()
    out["per_pos_accepted"] = per
    out["per_pos_acceptance"] = [a / d["drafts"] for a in per] if d["drafts"] else []
    return out


async def scrape(http: Any, url: str, timeout: float = 10.0) -> SpecSnapshot | None:
    """GET <url>/metrics with an httpx.AsyncClient; None when the server has no (reachable) /metrics."""
    import httpx

    try:
        r = await http.get(url.rstrip("/") + "/metrics", timeout=timeout)
    except (httpx.HTTPError, OSError):
        return None
    if r.status_code != 200:
        return None
    try:
        return parse_spec_metrics(r.text)
    except ValueError:  # not Prometheus text
        return None


def _step_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """verispec's step clock over a level: steps, rows per step, and ms per step in all and by phase."""
    n = after.get("steps", 0.0) - before.get("steps", 0.0)
    if n <= 0:
        return {}
    out = {"engine_steps": n, "rows_per_step": (after.get("tokens", 0.0) - before.get("tokens", 0.0)) / n}
    phases = [k for k in after if k not in ("steps", "tokens")]
    per = {p: (after[p] - before.get(p, 0.0)) / n * 1e3 for p in phases}
    out["step_ms"] = sum(per.values())
    out.update({f"step_{p}_ms": v for p, v in per.items()})
    return out


def _prefix_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Prompt tokens looked up in the prefix cache over a level, how many were found, and the hit rate (none when
    the server exports no such counters, or they went backwards: a restarted server)."""
    if not before or not after:
        return {}
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    if queries < 0 or hits < 0:
        return {}
    return {"prefix_queries": queries, "prefix_hits": hits,
            "prefix_hit_rate": hits / queries if queries > 0 else float("nan")}
