"""Arms of a single-stream comparison run interleaved: every prompt and repeat goes through every arm, in an order
that rotates, so a noisy neighbour slows all arms alike (docs/measuring.md: ratios from one run, interleaved)."""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from verispec.engine.counters import PHASES


@dataclass(frozen=True)
class ArmRun:
    """One arm on one prompt and repeat."""

    repeat: int
    prompt: int
    tokens: int  # output tokens
    seconds: float  # wall time of the whole request, prefill included
    tau: float  # tokens per target forward (1 without speculation)
    drafted_per_step: float  # draft tokens verified per step
    identical: bool  # output equal to the baseline arm's on the same prompt and repeat
    ttft: float = 0.0  # the engine's time to the first token (prefill), within `seconds`
    steps: int = 0  # engine steps that ran a forward (0: the engine keeps no step clock)
    phases: tuple[float, ...] = ()  # their seconds per phase of `engine.counters.PHASES`, summed
    stats: Mapping[str, Any] = field(default_factory=dict)  # the output's stats (what else a caller pools)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def _clock(llm: Any) -> tuple[int, dict[str, float]] | None:
    """The arm's engine step clock now (steps, seconds per phase); None for an arm without one."""
    clock = getattr(getattr(llm, "engine", None), "clock", None)
    return None if clock is None else (clock.steps, dict(clock.seconds))


def _clock_delta(before, after) -> tuple[int, tuple[float, ...]]:
    if before is None or after is None:
        return 0, ()
    return after[0] - before[0], tuple(after[1][p] - before[1][p] for p in PHASES)


def phase_row(runs: Sequence[ArmRun]) -> dict[str, float] | None:
    """ms per step of each phase over the runs, `other` (wall time outside the steps' phases: tokenizing, the API,
    output assembly) and `total`, with `steps`; None when the runs carry no step clock."""
    steps = sum(r.steps for r in runs)
    if not steps or not all(r.phases for r in runs):
        return None
    row = {p: 1e3 * sum(r.phases[i] for r in runs) / steps for i, p in enumerate(PHASES)}
    row["total"] = 1e3 * sum(r.seconds for r in runs) / steps
    row["other"] = row["total"] - sum(row[p] for p in PHASES)
    row["steps"] = steps
    return row


def run_interleaved(engines: Mapping[str, Any], prompts: Sequence[Any], params: Any, repeats: int,
                    baseline: str = "plain", own_length: bool = False) -> dict[str, list[ArmRun]]:
    """Each engine (an `LLM`) chats each prompt (a workload prompt with `.messages`) once per repeat; the arms'
    order rotates by one per prompt and repeat. Returns per arm its runs in (repeat, prompt) order. What drafters
    learn across requests (the suffix cache of earlier outputs, n-gram survival counts) is forgotten at the start of
    every repeat: a repeat would otherwise find its own greedy outputs from the one before. With `own_length`, each
    prompt runs to its own `max_tokens` (the workload's length) instead of `params`' (a `SamplingParams`)."""
    names = list(engines)
    if baseline not in engines:
        raise ValueError(f"the baseline arm {baseline!r} is not among {names}")
    rows: dict[str, list[ArmRun]] = {n: [] for n in names}
    for rep in range(repeats):
        for e in engines.values():
            e.drafters.reset_shared()
        for i, p in enumerate(prompts):
            r = (rep * len(prompts) + i) % len(names)
            outs = {}
            sp = dataclasses.replace(params, max_tokens=p.max_tokens) if own_length else params
            for name in names[r:] + names[:r]:
                c0, t0 = _clock(engines[name]), time.perf_counter()
                o = engines[name].chat([list(p.messages)], sp, use_tqdm=False)[0]
                dt = time.perf_counter() - t0
                outs[name] = (list(o.token_ids), o.stats, dt, _clock_delta(c0, _clock(engines[name])))
            want = outs[baseline][0]
            for name in names:
                ids, st, dt, (steps, phases) = outs[name]
                rows[name].append(ArmRun(rep, i, len(ids), dt, st.get("mean_acceptance_length", 1.0),
                                         st.get("num_draft_tokens", 0) / max(1, st.get("steps", 1)), ids == want,
                                         st.get("ttft_s", 0.0), steps, phases, st))
    return rows


def pooled_ratios(runs: Sequence[ArmRun], base: Sequence[ArmRun], repeats: int, decode: bool = False) -> list[float]:
    """Per repeat: all tokens / all seconds of the arm over the prompts, divided by the baseline's. With `decode`,
    the tokens after the first over the seconds after the first token (TPOT's rate: prefill, which speculation does
    not change, left out)."""
    def rate(xs: Sequence[ArmRun]) -> float:
        if decode:
            return sum(x.tokens - 1 for x in xs) / sum(x.seconds - x.ttft for x in xs)
        return sum(x.tokens for x in xs) / sum(x.seconds for x in xs)

    return [rate([x for x in runs if x.repeat == rep]) / rate([x for x in base if x.repeat == rep])
            for rep in range(repeats)]


def per_prompt_ratios(runs: Sequence[ArmRun], base: Sequence[ArmRun]) -> list[float]:
    """The arm's tok/s over the baseline's on the same prompt and repeat."""
    return [a.tok_s / b.tok_s for a, b in zip(runs, base)]


def compare_arms(description: str, arms: Callable[[Any, int], dict[str, Any]], argv=None,
                 default_limit: int = 4) -> int:
    """The command line of a side-by-side benchmark: `arms(base LLM, k)` -> named engines (one of them "plain"),
    run interleaved on the first --limit prompts of each workload; one table row per workload and arm."""
    import argparse

    from verispec import LLM, SamplingParams
    from verispec.bench.load import MachineLoad
    from verispec.bench.workloads import WORKLOADS, load_workload

    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=default_limit)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128,
                    help="output tokens per request; 0: each prompt's own (the workload's: 192, chat 128)")
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per step of the adaptive policies")
    ap.add_argument("--phases", action="store_true",
                    help="also a table of each arm's ms per engine step by phase (where an arm's time goes)")
    args = ap.parse_args(argv)
    base = LLM(args.model, dtype="auto", device="cpu", max_model_len=2048, progress=False)
    engines = arms(base, args.k)
    for e in engines.values():
        if e.spec.method != "none":
            _ = e.costs  # the start-up profile, outside the timed runs
    print(base.path_choice.describe())
    print("output tokens per request:", args.max_tokens or "each prompt's own (the workload's max_tokens)")
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens or 1)  # 0: replaced per prompt
    print("\n| workload | arm | tok/s | pooled, per repeat | decode only, pooled | per prompt (min..max) | tau "
          "| drafted per step | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    load = MachineLoad().start()
    phase_rows = []
    for wl in args.workloads.split(","):
        rows = run_interleaved(engines, load_workload(wl, limit=args.limit), sp, args.repeats,
                               own_length=args.max_tokens == 0)
        phase_rows += [(wl, name, phase_row(rs)) for name, rs in rows.items()]
        for name, rs in rows.items():
            pooled = " / ".join(f"x{x:.2f}" for x in pooled_ratios(rs, rows["plain"], args.repeats))
            decode = " / ".join(f"x{x:.2f}" for x in pooled_ratios(rs, rows["plain"], args.repeats, decode=True))
            ratio = per_prompt_ratios(rs, rows["plain"])
            same = sum(x.identical for x in rs)
            print(f"| {wl} | {name} | {statistics.median(x.tok_s for x in rs):.1f} | {pooled} | {decode} | "
                  f"x{statistics.median(ratio):.2f} ({min(ratio):.2f}..{max(ratio):.2f}) | "
                  f"{statistics.fmean(x.tau for x in rs):.2f} | "
                  f"{statistics.fmean(x.drafted_per_step for x in rs):.2f} | {same}/{len(rs)} |", flush=True)
    if args.phases:
        print_phases(phase_rows)
    print(f"\n{load.stop().describe()}")
    return 0


def print_phases(rows: Sequence[tuple[str, str, dict[str, float] | None]]) -> None:
    """The table of `phase_row`s: per workload and arm, ms per engine step by phase."""
    print("\nms per engine step (prefill steps included), by phase; other = the request's wall time outside the "
          "steps' phases\n")
    print("| workload | arm | steps | " + " | ".join(PHASES) + " | other | total |")
    print("|---|---|---|" + "---|" * (len(PHASES) + 2))
    for wl, name, row in rows:
        if row is not None:
            print(f"| {wl} | {name} | {row['steps']:.0f} | "
                  + " | ".join(f"{row[p]:.3f}" for p in (*PHASES, "other", "total")) + " |")
