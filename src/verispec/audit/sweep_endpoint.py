"""The acceptance sweep against servers: one OpenAI-compatible endpoint per value (`--endpoint VALUE=SPEC`).

On SGLang the threshold is a server flag (`--speculative-accept-threshold-single` / `-acc`), so one server serves
one value. The sweep's jobs, items and seeds are the in-process sweep's (audit/sweep.py `run_sweep`); generation goes
through `EndpointSide` (/v1/chat/completions). tau comes from the server's /metrics, scraped before and after each
(value, temperature) run (bench/promscrape.py: verispec's and vLLM's counters give the run's delta; SGLang's gauge
gives its recent mean acceptance length); None when the server exports none. The relaxed-token share and the TV
distance to the target need p and q at every verified position, which a server does not return: None (in-process
only).
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any, Sequence

from verispec.audit.runner import EndpointSide, Job
from verispec.audit.spec import EndpointSpec, parse_spec

SETTLE_S = 2.0  # how long the after-scrape waits for the server to report no running / waiting requests


def parse_endpoint_arg(text: str) -> tuple[float, EndpointSpec]:
    """`0.8=url=http://host:30001,model=M` -> (0.8, EndpointSpec)."""
    value, eq, spec_text = text.partition("=")
    if not eq or not spec_text.strip():
        raise ValueError(f"--endpoint takes VALUE=SPEC, e.g. 0.8=url=http://host:30001,model=M; got {text!r}")
    try:
        v = float(value)
    except ValueError:
        raise ValueError(f"--endpoint takes VALUE=SPEC with VALUE a number in (0, 1] before the first '=' "
                         f"(e.g. 0.8=url=http://host:30001); got {text!r}") from None
    if not 0 < v <= 1:
        raise ValueError(f"--endpoint {text!r}: VALUE must be in (0, 1] (1.0 = strict verification), got {v:g}")
    return v, endpoint_spec(spec_text, f"--endpoint {text!r}")


def endpoint_spec(text: str, what: str) -> EndpointSpec:
    spec = parse_spec(text)
    if not isinstance(spec, EndpointSpec):
        raise ValueError(f"{what}: SPEC must name a server, url=http://host:port[/v1][,model=NAME][,key=KEY]")
    return spec


def parse_endpoints(endpoints: Sequence[str], reference: str | None,
                    param: str) -> tuple[EndpointSpec, dict[float, EndpointSpec]]:
    """(reference spec, {value: spec}, highest value first). The reference is `reference` or value 1.0's server."""
    if not endpoints:
        raise ValueError("--reference-endpoint needs at least one --endpoint VALUE=SPEC to compare against it")
    values: dict[float, EndpointSpec] = {}
    for text in endpoints:
        v, spec = parse_endpoint_arg(text)
        if v in values:
            raise ValueError(f"--endpoint value {v:g} given twice: one server serves one value")
        values[v] = dataclasses.replace(spec, label=spec.label or f"{param}={v:g} @ {spec.describe()}")
    if reference is not None:
        ref = endpoint_spec(reference, "--reference-endpoint")
    elif 1.0 in values:
        ref = values[1.0]
    else:
        raise ValueError("endpoint mode needs a strict-verification reference: --reference-endpoint SPEC, or an "
                         "--endpoint 1.0=SPEC (the server at threshold 1, i.e. exact verification)")
    ref = dataclasses.replace(ref, label=f"{ref.describe()} (strict verification, reference)")
    return ref, dict(sorted(values.items(), reverse=True))


class ScrapedEndpointSide(EndpointSide):
    """An EndpointSide that scrapes the server's /metrics around each `generate` (one temperature per call, as
    run_sweep calls it) and keeps, per temperature, the spec-decode delta and the generation's own wall time."""

    def __init__(self, spec: EndpointSpec, concurrency: int = 8, timeout: float = 600.0) -> None:
        super().__init__(spec, concurrency, timeout)
        self.measured: dict[float, dict[str, Any]] = {}

    def generate(self, jobs: Sequence[Job], progress: bool, desc: str) -> list:
        temps = {j.temperature for j in jobs}
        assert len(temps) == 1, f"one temperature per run, got {sorted(temps)}"
        before = self.scrape()
        t0 = time.perf_counter()
        gens = super().generate(jobs, progress, desc)
        wall = time.perf_counter() - t0
        after = self.scrape(settle=True)
        from verispec.bench.promscrape import spec_delta

        self.measured[temps.pop()] = {"wall_s": wall, "metrics": spec_delta(before, after)}
        return gens

    def scrape(self, settle: bool = False) -> Any:
        """One SpecSnapshot of <root>/metrics (None without one). With `settle`, re-read while the server still
        reports running or waiting requests (its counters may trail the last response by one step)."""
        import httpx

        from verispec.bench.client import base_url
        from verispec.bench.promscrape import parse_spec_metrics

        headers = {"Authorization": f"Bearer {self.spec.key}"} if self.spec.key else {}
        deadline = time.monotonic() + SETTLE_S
        while True:
            try:
                r = httpx.get(base_url(self.spec.url) + "/metrics", headers=headers, timeout=10.0)
                snap = parse_spec_metrics(r.text) if r.status_code == 200 else None
            except (httpx.HTTPError, OSError, ValueError):
                return None
            if not settle or snap is None or not snap.busy or time.monotonic() > deadline:
                return snap
            time.sleep(0.02)


def build_endpoint_sweep_sides(reference: EndpointSpec, values: dict[float, EndpointSpec], concurrency: int = 8
                               ) -> tuple[ScrapedEndpointSide, dict[float, ScrapedEndpointSide]]:
    return (ScrapedEndpointSide(reference, concurrency),
            {v: ScrapedEndpointSide(s, concurrency) for v, s in values.items()})


def _tau(delta: dict[str, Any] | None) -> float | None:
    tau = (delta or {}).get("tau")
    return None if tau is None or (isinstance(tau, float) and math.isnan(tau)) else float(tau)


def apply_endpoint_measurements(rows: list[dict[str, Any]], runs: list[dict[str, Any]],
                                reference: ScrapedEndpointSide, candidates: dict[float, ScrapedEndpointSide]) -> None:
    """In place: each run's wall time becomes the generation's own (scrapes excluded) and carries its /metrics
    delta; each row's tau is the delta's (None without metrics); relaxed share and TV are None (not measurable)."""
    def side(v: float | None) -> ScrapedEndpointSide:
        return reference if v is None else candidates[v]

    for run in runs:
        m = side(run["value"]).measured.get(run["temperature"])
        if m is not None:
            run.update(wall_s=m["wall_s"], metrics=m["metrics"],
                       tok_per_s=run["output_tokens"] / m["wall_s"] if m["wall_s"] > 0 else 0.0)
    for row in rows:
        m = side(row["value"]).measured.get(row["temperature"]) or {}
        run = next(r for r in runs if r["value"] == row["value"] and r["temperature"] == row["temperature"])
        row.update(tau=_tau(m.get("metrics")), tau_source=(m.get("metrics") or {}).get("spec_source", "none"),
                   tok_per_s=run["tok_per_s"], accepted=None, relaxed=None, relaxed_share=None, tv_mean=None,
                   tv_positions=None)


ENDPOINT_METRIC = (
    "tau = the server's mean acceptance length over the run, from /metrics scraped before and after it (verispec / "
    "vLLM counters: 1 + accepted / drafts of the delta; SGLang: its spec_accept_length gauge at the run's end, a "
    "recent-batches mean), n/a without spec-decode metrics; tok/s = output tokens (token ids, else usage) / wall "
    "time of the run's requests; relaxed % and TV: n/a (in process only: they need p and q at every verified "
    "position); byte-identical: token ids where both servers return them, else text")


def run_endpoint_sweep_cli(args: Any, temps: list[float], load_items: Any) -> int:
    from verispec.audit.sweep import SWEEP_RULES, PARAMS, run_sweep, sweep_rows
    from verispec.audit.sweep_report import build_sweep_report, publish_sweep_report

    if args.rule not in SWEEP_RULES or args.param not in PARAMS:
        raise ValueError(f"--rule must be one of {', '.join(SWEEP_RULES)} and --param one of {', '.join(PARAMS)}")
    ref_spec, value_specs = parse_endpoints(args.endpoint, args.reference_endpoint, args.param)
    if args.samples < 1 or args.bootstrap < 100 or args.concurrency < 1:
        raise ValueError("need --samples >= 1, --bootstrap >= 100 and --concurrency >= 1")
    items = load_items()
    ref, cands = build_endpoint_sweep_sides(ref_spec, value_specs, args.concurrency)
    records, runs = run_sweep(items, ref, cands, temps, args.samples, args.seed, args.max_tokens,
                              progress=not args.quiet)
    rows, domains = sweep_rows(records, runs, args.bootstrap, args.seed)
    apply_endpoint_measurements(rows, runs, ref, cands)
    setup = (f"{len(items)} item(s), temperatures {', '.join(f'{t:g}' for t in temps)}, {args.samples} sample(s) "
             f"per item at T > 0, seed {args.seed}; servers: "
             + "; ".join(f"{v:g}: {s.describe()}" for v, s in cands.items())
             + (f", max_tokens capped at {args.max_tokens}" if args.max_tokens else ""))
    rep = build_sweep_report(records, runs, rows, domains, rule=args.rule, param=args.param,
                             reference=ref.describe(), n_resamples=args.bootstrap, seed=args.seed, setup=setup,
                             concurrency=f"up to {args.concurrency} requests in flight per server; the reference, "
                                         "then each value's server, one after another per temperature",
                             metric=ENDPOINT_METRIC + f"; quality = per-domain grader score, paired delta value - "
                                    f"reference per (item, temperature, sample), bootstrap 95% interval "
                                    f"({args.bootstrap} resamples, seed {args.seed})",
                             baseline=f"{ref.describe()}: same items, temperatures, per-(item, sample) seeds and "
                                      "max_tokens (what the servers share beyond the value is the user's to ensure)")
    return publish_sweep_report(rep, args.out)
