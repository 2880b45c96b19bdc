"""`verispec bench sweep`: a serving benchmark of any OpenAI-compatible endpoint (verispec serve, vLLM, SGLang,
llama.cpp's server), optionally paired with a speculation-off baseline endpoint.

Levels: closed loop at fixed concurrency C (C clients, each sends its next request when the previous one ends)
and/or open loop at Poisson request rates R (seeded exponential inter-arrival times; requests are sent on time
whatever is in flight). Every level is bounded twice: at most N requests (`--requests-per-level`) and at most S
seconds (`--max-seconds-per-level`): at S no new request is sent, the ones in flight get a grace period
(`--grace-seconds`), and what is still running then is cancelled and counted as an error of class "timeout".

Per level: request/s, aggregate output tok/s, goodput, P50/P95/P99 of TTFT, TPOT, per-token ITL, raw inter-chunk
gap, E2E and time to response headers (definitions: `verispec.bench.client`), errors by class, speculative
acceptance from the server's /metrics before and after the level (`verispec.bench.promscrape`), and identity: the
share of requests whose greedy output equals the same prompt's output at the reference level (the lowest
concurrency, else the lowest rate) of the same endpoint, with the first divergent index. With a baseline, the two
endpoints run the same prompts level by level, interleaved (A B at one level, B A at the next, ...), and the
report gives their ratio at every level.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from verispec.bench.load import MachineLoad
from verispec.bench.report import write_report
from verispec.bench.sweep_report import build_report, mark_identity, summarize
from verispec.bench.sweep_types import Level, LevelResult

DEFAULT_CONCURRENCY = "1,8,32,64,128"


# ---- arguments ---------------------------------------------------------------------------------------------
def _floats(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not vals or any(v <= 0 or math.isinf(v) or math.isnan(v) for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers, got {s!r}")
    return vals


def _ints(s: str) -> list[int]:
    try:
        vals = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {s!r}")
    return vals


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """The options of `verispec bench sweep`."""
    p = parser
    p.add_argument("--endpoint", required=True,
                   help="the server to measure: its root or /v1 URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--baseline-endpoint", default=None,
                   help="the same model with speculation off: a paired sweep, with the ratio at every level")
    p.add_argument("--label", default="spec", help="name of --endpoint in the report (default: %(default)s)")
    p.add_argument("--baseline-label", default="baseline", help="name of --baseline-endpoint (default: %(default)s)")
    p.add_argument("--concurrency", type=_ints, default=None,
                   help=f"closed-loop levels, e.g. {DEFAULT_CONCURRENCY} (the default when no --request-rate)")
    p.add_argument("--request-rate", type=_floats, default=None,
                   help="open-loop levels: Poisson arrival rates in requests/s, e.g. 0.5,1,2")
    p.add_argument("--workloads", default=None,
                   help="comma-separated shipped workload names or JSONL paths (default: every shipped set, mixed)")
    p.add_argument("--api", default="chat", choices=["chat", "completions"],
                   help="/v1/chat/completions (messages) or /v1/completions (the messages' text as the prompt)")
    p.add_argument("--max-tokens", type=int, default=None,
                   help="output tokens per request (default: each prompt's own max_tokens)")
    p.add_argument("--requests-per-level", type=int, default=None,
                   help="requests per level (default: max(64, 2 x concurrency); 64 per rate level)")
    p.add_argument("--max-seconds-per-level", type=float, default=300.0,
                   help="stop sending new requests after this many seconds (default: %(default)s)")
    p.add_argument("--grace-seconds", type=float, default=30.0,
                   help="then wait this long for requests in flight before cancelling them as timeouts "
                        "(default: %(default)s)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every level this many times (ratios: median and min..max over repeats)")
    p.add_argument("--warmup-requests", type=int, default=0,
                   help="before the first level, send each endpoint this many requests (the pool's prompts in "
                        "order, as many at once as the highest concurrency level), not measured: a fresh server's "
                        "first level otherwise carries its cold start (empty prefix cache, first allocations) "
                        "(default: %(default)s)")
    p.add_argument("--reset-prefix-cache", action="store_true",
                   help="empty each server's prefix cache before every level it runs (POST /reset_prefix_cache: "
                        "verispec serve --enable-dev-endpoints, vLLM's dev mode; SGLang's /flush_cache), so that no "
                        "level finds the prompts an earlier level or the warm-up cached")
    p.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO on TTFT, seconds")
    p.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO on TPOT, seconds")
    p.add_argument("--slo-e2e", type=float, default=None, help="goodput SLO on E2E latency, seconds")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="sent as 'Authorization: Bearer KEY' to both endpoints (default: $OPENAI_API_KEY)")
    p.add_argument("--model", default=None, help="model name sent (default: the first id of GET /v1/models)")
    p.add_argument("--baseline-model", default=None, help="model name sent to the baseline (default: as --model)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default), which makes the identity column meaningful")
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (verispec, vLLM, SGLang): every request makes exactly max_tokens")
    p.add_argument("--seed", type=int, default=0, help="seed of the Poisson arrivals (default: %(default)s)")
    p.add_argument("--request-timeout", type=float, default=None,
                   help="per-request HTTP timeout, seconds (default: the level's time limit plus grace)")
    p.add_argument("--probe-timeout", type=float, default=120.0,
                   help="the warm-up probe of each endpoint (default: %(default)s s)")
    p.add_argument("--metrics-timeout", type=float, default=5.0,
                   help="timeout of each /metrics scrape (default: %(default)s s)")
    p.add_argument("--no-metrics", action="store_true", help="do not scrape /metrics")
    p.add_argument("--out", default=None, help="report directory (default: reports/sweep-<date-time>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def sweep_options(**values: Any) -> argparse.Namespace:
    """The options of `verispec bench sweep` (see `add_sweep_args`) as parsed values: each option's default,
    overridden by `values` (keyword = the option's destination, e.g. concurrency=[1], baseline_endpoint=URL)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_sweep_args(parser)
    options = {a.dest: a.default for a in parser._actions}
    unknown = set(values) - set(options)
    if unknown:
        raise TypeError(f"unknown sweep options {sorted(unknown)}")
    return argparse.Namespace(**{**options, **values})


# ---- levels and prompts ------------------------------------------------------------------------------------
def plan_levels(concurrency: Sequence[int] | None, rates: Sequence[float] | None,
                requests_per_level: int | None) -> list[Level]:
    if not concurrency and not rates:
        concurrency = _ints(DEFAULT_CONCURRENCY)
    levels = [Level("concurrency", c, requests_per_level or max(64, 2 * c)) for c in concurrency or []]
    levels += [Level("rate", r, requests_per_level or 64) for r in rates or []]
    return levels


def reference_level(levels: Sequence[Level]) -> Level:
    closed = [lv for lv in levels if lv.mode == "concurrency"]
    return min(closed or levels, key=lambda lv: lv.value)


def build_pool(workloads: Sequence[str] | None) -> list[Any]:
    """The prompts of the given workloads, mixed: round-robin over the sets, in file order within each."""
    from verispec.bench.client import Prompt
    from verispec.bench.workloads import WORKLOADS, load_workload

    sets = [load_workload(w) for w in (workloads or WORKLOADS)]
    pool = []
    for i in range(max(len(s) for s in sets)):
        for s in sets:
            if i < len(s):
                wp = s[i]
                pool.append(Prompt(wp.id, wp.workload, messages=[dict(m) for m in wp.messages],
                                   max_tokens=wp.max_tokens))
    return pool


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s from the level start) of n requests at `rate`/s: cumulative exponential gaps, first at 0."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


# ---- one level ---------------------------------------------------------------------------------------------
async def _scrape_settled(http: Any, url: str, timeout: float, settle_s: float = 5.0) -> Any:
    """A /metrics snapshot taken once the server reports nothing running or waiting (where it says so), so
    that the counters include the last step of the level's last request."""
    from verispec.bench.promscrape import scrape

    deadline = time.perf_counter() + settle_s
    while True:
        snap = await scrape(http, url, timeout)
        if snap is None or snap.busy is None or snap.busy == 0 or time.perf_counter() > deadline:
            return snap
        await asyncio.sleep(0.05)


async def run_level(client: Any, pool: Sequence[Any], level: Level, *, repeat: int = 0, max_seconds: float,
                    grace: float, max_tokens: int | None, seed: int, metrics: bool = True,
                    metrics_timeout: float = 5.0, progress: bool = True) -> LevelResult:
    """Run one bounded level against `client` (an EndpointClient) and return its records and spec deltas."""
    from verispec.bench.promscrape import spec_delta

    before = await _scrape_settled(client.http, client.base, metrics_timeout) if metrics else None
    bar = _bar(level.requests, f"{client.label} {level.name}" + (f" #{repeat + 1}" if repeat else ""), progress)
    run = _LevelRun(client, pool, level, repeat, max_tokens, bar, time.perf_counter() + max_seconds)
    sampler = _GaugeSampler(client, metrics_timeout) if before is not None and before.family == "sglang" else None
    tasks = run.closed_loop() if level.mode == "concurrency" else await run.open_loop(seed)
    if tasks:
        await asyncio.wait(tasks, timeout=max(0.0, run.stop_at + grace - time.perf_counter()))
    for t in tasks:
        if not t.done():
            t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    t_end = time.perf_counter()
    gauge_samples = await sampler.stop() if sampler is not None else []
    for rec in run.records:
        if rec.status == "pending":
            rec.fail("timeout", f"cancelled at the level's limit ({max_seconds:g} s + {grace:g} s grace)")
    if bar is not None:
        bar.close()
    after = await _scrape_settled(client.http, client.base, metrics_timeout) if metrics else None
    run.records.sort(key=lambda r: r.index)
    return LevelResult(client.label, level, repeat, run.records, t_end - run.t0,
                       spec_delta(before, after, gauge_samples), run.max_in_flight)


class _LevelRun:
    """The requests of one level as they are sent: a record each, and how many are in flight at most."""

    def __init__(self, client: Any, pool: Sequence[Any], level: Level, repeat: int, max_tokens: int | None,
                 bar: Any, stop_at: float) -> None:
        self.client, self.pool, self.level, self.repeat, self.max_tokens = client, pool, level, repeat, max_tokens
        self.bar, self.stop_at = bar, stop_at
        self.records: list[Any] = []
        self.in_flight = self.max_in_flight = 0
        self.t0 = time.perf_counter()

    async def one(self, i: int) -> None:
        """Send request i (prompt i of the pool, cycled) and record it; a client-side failure is its own error."""
        from verispec.bench.client import RequestRecord

        p = self.pool[i % len(self.pool)]
        rec = RequestRecord(i, p.id, p.workload, endpoint=self.client.label, level=self.level.name)
        rec.repeat = self.repeat + 1
        self.records.append(rec)
        rec.send_at = time.perf_counter() - self.t0
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await self.client.request(p, rec, self.max_tokens)
        except Exception as e:  # noqa: BLE001 - a client-side failure is this request's error, not the level's
            rec.fail("client", f"{type(e).__name__}: {e}")
        finally:
            self.in_flight -= 1
            if self.bar is not None:
                self.bar.update(1)

    def closed_loop(self) -> list[asyncio.Task]:
        """C workers, each sending its next request when its last one ended, until N are sent or time is up."""
        next_i = 0

        async def worker() -> None:
            nonlocal next_i
            while next_i < self.level.requests and time.perf_counter() < self.stop_at:
                i, next_i = next_i, next_i + 1
                await self.one(i)

        return [asyncio.create_task(worker()) for _ in range(min(int(self.level.value), self.level.requests))]

    async def open_loop(self, seed: int) -> list[asyncio.Task]:
        """Requests sent at seeded Poisson arrival times, whatever is in flight, until time is up."""
        tasks = []
        for i, at in enumerate(poisson_arrivals(self.level.value, self.level.requests, seed)):
            if self.t0 + at >= self.stop_at:
                break
            await asyncio.sleep(max(0.0, self.t0 + at - time.perf_counter()))
            tasks.append(asyncio.create_task(self.one(i)))
        return tasks


class _GaugeSampler:
    """Scrapes /metrics every second while a level runs (SGLang's acceptance is a gauge, not a counter)."""

    def __init__(self, client: Any, timeout: float) -> None:
        self.samples: list[Any] = []
        self.task = asyncio.create_task(self._sample(client, timeout))

    async def _sample(self, client: Any, timeout: float) -> None:
        from verispec.bench.promscrape import scrape

        while True:
            await asyncio.sleep(1.0)
            s = await scrape(client.http, client.base, timeout)
            if s is not None:
                self.samples.append(s)

    async def stop(self) -> list[Any]:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        return self.samples


def _bar(total: int, desc: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", leave=True, dynamic_ncols=True, file=sys.stderr)


# ---- the sweep ---------------------------------------------------------------------------------------------
def run_sweep(args: argparse.Namespace) -> int:
    """Run the sweep described by `args` (see `add_sweep_args`) and write the report. 0 when some request of the
    sweep completed, 1 when none did (the report is written either way), 2 on a setup error."""
    try:
        return asyncio.run(_sweep(args))
    except (ValueError, RuntimeError) as e:
        print(f"verispec bench sweep: error: {e}", file=sys.stderr)
        return 2


async def _sweep(args: argparse.Namespace) -> int:
    _check_args(args)
    levels = plan_levels(args.concurrency, args.request_rate, args.requests_per_level)
    pool = build_pool([w.strip() for w in args.workloads.split(",") if w.strip()] if args.workloads else None)
    clients = _clients(args, levels)
    say = _say(not args.no_progress)
    load = MachineLoad()
    try:
        await _probe(clients, pool, args, say)
        await _warm_up(clients, pool, levels, args, say)
        load.start()
        results = await _run_levels(clients, pool, levels, args, say)
        load.stop()
    finally:
        for c in clients:
            await c.aclose()
    ref = reference_level(levels)
    base_label = clients[1].label if len(clients) > 1 else None
    for label, rs in results.items():
        mark_identity(rs, ref, results[base_label] if base_label and label != base_label else ())
    out = Path(args.out) if args.out else Path("reports") / time.strftime("sweep-%Y%m%d-%H%M%S")
    rep = build_report(args, levels, ref, clients, results, pool)
    rep.notes.append(load.describe("a server under test on this machine counts here"))
    if args.reset_prefix_cache:
        rep.notes.append("Each server's prefix cache was emptied before every level it ran (--reset-prefix-cache).")
    paths = write_report(rep, out)
    say(f"report: {paths['md']} (also {paths['html'].name}, {paths['json'].name}, {paths['csv'].name}, PNGs)")
    completed = sum(r.ok for rs in results.values() for res in rs for r in res.records)
    return 0 if completed else 1


def _check_args(args: argparse.Namespace) -> None:
    if args.max_tokens is not None and args.max_tokens < 1:
        raise ValueError("--max-tokens must be >= 1")
    if args.repeats < 1:
        raise ValueError("--repeats must be >= 1")
    if args.requests_per_level is not None and args.requests_per_level < 1:
        raise ValueError("--requests-per-level must be >= 1")
    if args.max_seconds_per_level <= 0 or args.grace_seconds < 0:
        raise ValueError("need --max-seconds-per-level > 0 and --grace-seconds >= 0")
    if args.warmup_requests < 0:
        raise ValueError("--warmup-requests must be >= 0")


def _clients(args: argparse.Namespace, levels: Sequence[Level]) -> list[Any]:
    """The endpoint under test, then the baseline if one is given."""
    from verispec.bench.client import EndpointClient

    req_timeout = args.request_timeout or (args.max_seconds_per_level + args.grace_seconds + 5)
    max_conn = max([int(lv.value) for lv in levels if lv.mode == "concurrency"] + [64]) * 2
    endpoints = [(args.label, args.endpoint, args.model)]
    if args.baseline_endpoint:
        endpoints.append((args.baseline_label, args.baseline_endpoint, args.baseline_model or args.model))
    return [EndpointClient(url, api=args.api, model=model, api_key=args.api_key, max_connections=max_conn,
                           request_timeout=req_timeout, temperature=args.temperature, ignore_eos=args.ignore_eos,
                           label=label) for label, url, model in endpoints]


async def _probe(clients: Sequence[Any], pool: Sequence[Any], args: argparse.Namespace, say: Any) -> None:
    """Each endpoint's model name and the token-count extensions it accepts, said before any level runs."""
    for c in clients:
        try:
            model = await c.resolve_model(timeout=args.probe_timeout)
        except Exception as e:  # noqa: BLE001 - any failure to list models is a setup error
            raise RuntimeError(f"cannot read {c.base}/v1/models ({type(e).__name__}: {e}); is the server up? "
                               "(or pass --model)") from None
        caps = await c.probe(pool[0], timeout=args.probe_timeout)
        reset = await c.reset_prefix_cache(timeout=args.probe_timeout) if args.reset_prefix_cache else None
        say(f"{c.label}: {c.base}, model {model!r}, token counts from {caps.token_source}"
            + (f" ({caps.note})" if caps.note else "") + (f", prefix cache reset by POST {reset}" if reset else ""))


async def _warm_up(clients: Sequence[Any], pool: Sequence[Any], levels: Sequence[Level], args: argparse.Namespace,
                   say: Any) -> None:
    """--warmup-requests: a closed-loop level per endpoint that is run and dropped (failures are said, not fatal)."""
    n = args.warmup_requests
    if not n:
        return
    conc = max([int(lv.value) for lv in levels if lv.mode == "concurrency"] + [1])
    warm = Level("concurrency", min(conc, n), n)
    for c in clients:
        res = await run_level(c, pool, warm, max_seconds=args.max_seconds_per_level, grace=args.grace_seconds,
                              max_tokens=args.max_tokens, seed=args.seed, metrics=False, progress=False)
        ok = sum(r.ok for r in res.records)
        say(f"{c.label}: warm-up, {ok}/{len(res.records)} requests ok in {res.duration_s:.1f} s (not measured)")


async def _run_levels(clients: Sequence[Any], pool: Sequence[Any], levels: Sequence[Level],
                      args: argparse.Namespace, say: Any) -> dict[str, list[LevelResult]]:
    """Every level of every repeat on every endpoint, the endpoints' order alternating (A B, then B A)."""
    results: dict[str, list[LevelResult]] = {c.label: [] for c in clients}
    for rep in range(args.repeats):
        for j, level in enumerate(levels):
            for c in clients if (j + rep) % 2 == 0 else clients[::-1]:
                if args.reset_prefix_cache:
                    await c.reset_prefix_cache(timeout=args.probe_timeout, wait_s=args.grace_seconds + 5)
                res = await run_level(c, pool, level, repeat=rep, max_seconds=args.max_seconds_per_level,
                                      grace=args.grace_seconds, max_tokens=args.max_tokens, seed=args.seed + j,
                                      metrics=not args.no_metrics, metrics_timeout=args.metrics_timeout,
                                      progress=not args.no_progress)
                results[c.label].append(res)
                row = summarize(res)
                say(f"{c.label} {level.name}: {row['completed']}/{row['sent']} ok, {row['req_per_s']:.2f} req/s, "
                    f"{row['out_tok_per_s']:.1f} tok/s, P50 TPOT {row['tpot_p50_ms']:.1f} ms, "
                    f"tau {row['tau']:.2f}, errors {row['errors_by_class']}")
    return results


def _say(progress: bool):
    def say(msg: str) -> None:
        if progress:
            from tqdm import tqdm

            tqdm.write(msg, file=sys.stderr)
        else:
            print(msg, file=sys.stderr)
    return say
