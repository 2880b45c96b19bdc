"""Arms of a single-stream comparison run interleaved: every prompt and repeat goes through every arm, in an order
that rotates, so a noisy neighbour slows all arms alike (MEASURE.md: ratios from one run, interleaved)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence


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

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def run_interleaved(engines: Mapping[str, Any], prompts: Sequence[Any], params: Any, repeats: int,
                    baseline: str = "plain") -> dict[str, list[ArmRun]]:
    """Each engine (an `LLM`) chats each prompt (a workload prompt with `.messages`) once per repeat; the arms'
    order rotates by one per prompt and repeat. Returns per arm its runs in (repeat, prompt) order. What drafters
    learn across requests (the suffix cache of earlier outputs, n-gram survival counts) is forgotten at the start of
    every repeat: a repeat would otherwise find its own greedy outputs from the one before."""
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
            for name in names[r:] + names[:r]:
                t0 = time.perf_counter()
                o = engines[name].chat([list(p.messages)], params, use_tqdm=False)[0]
                outs[name] = (list(o.token_ids), o.stats, time.perf_counter() - t0)
            want = outs[baseline][0]
            for name in names:
                ids, st, dt = outs[name]
                rows[name].append(ArmRun(rep, i, len(ids), dt, st.get("mean_acceptance_length", 1.0),
                                         st.get("num_draft_tokens", 0) / max(1, st.get("steps", 1)), ids == want,
                                         st.get("ttft_s", 0.0)))
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
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="most draft tokens per step of the adaptive policies")
    args = ap.parse_args(argv)
    base = LLM(args.model, dtype="auto", device="cpu", max_model_len=2048, progress=False)
    engines = arms(base, args.k)
    for e in engines.values():
        if e.spec.method != "none":
            _ = e.costs  # the start-up profile, outside the timed runs
    print(base.path_choice.describe())
    sp = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    print("\n| workload | arm | tok/s | pooled, per repeat | decode only, pooled | per prompt (min..max) | tau "
          "| drafted per step | identical |")
    print("|---|---|---|---|---|---|---|---|---|")
    load = MachineLoad().start()
    for wl in args.workloads.split(","):
        rows = run_interleaved(engines, load_workload(wl, limit=args.limit), sp, args.repeats)
        for name, rs in rows.items():
            pooled = " / ".join(f"x{x:.2f}" for x in pooled_ratios(rs, rows["plain"], args.repeats))
            decode = " / ".join(f"x{x:.2f}" for x in pooled_ratios(rs, rows["plain"], args.repeats, decode=True))
            ratio = per_prompt_ratios(rs, rows["plain"])
            same = sum(x.identical for x in rs)
            print(f"| {wl} | {name} | {statistics.median(x.tok_s for x in rs):.1f} | {pooled} | {decode} | "
                  f"x{statistics.median(ratio):.2f} ({min(ratio):.2f}..{max(ratio):.2f}) | "
                  f"{statistics.fmean(x.tau for x in rs):.2f} | "
                  f"{statistics.fmean(x.drafted_per_step for x in rs):.2f} | {same}/{len(rs)} |", flush=True)
    print(f"\n{load.stop().describe()}")
    return 0
