"""The cost model's well-measured points against the line alone: what the adaptive policies make of n-gram drafts.

`MeasuredStepCosts` reads the engine's measured forwards as a least-squares line; since 2026-12-03 a token count
measured `min_count` times also bounds it from below (engine/costs.py). This runs the same policy both ways, side
by side, with plain decoding and static K = 3 as references.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`,
the first `--limit` prompts of each shipped workload, `--repeats` repeats, the arms interleaved (order rotated per
prompt and repeat). Metric: output tok/s of one stream, prefill included; tau = tokens per target forward; drafted
= draft tokens verified per step. Baseline: plain decoding on the same prompt and repeat (ratio per pair, median
and min..max); identity: every arm's output against plain's.

    python benchmarks/cost_bound.py --limit 4 --repeats 2      (about 5 minutes on a 2-core CPU)
"""

from __future__ import annotations

import argparse
import statistics
import time

from verispec import LLM, SamplingParams
from verispec.bench.load import MachineLoad
from verispec.bench.workloads import WORKLOADS, load_workload

LINE_ONLY = 10 ** 9  # min_count no token count reaches: the line alone, as before


def arms(base: LLM, k: int) -> dict[str, LLM]:
    out = {"plain": base}
    for sched in ("goodput", "dspark"):
        for bound in (False, True):
            e = base.with_speculation({"method": "ngram", "num_speculative_tokens": k})
            e.configure_engine(scheduler=sched)
            if not bound:
                e.engine.policy.costs.min_count = LINE_ONLY
            out[f"{sched}, {'bounded' if bound else 'line only'}"] = e
    out["static K=3"] = base.with_speculation({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=4)
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
    print("\n| workload | arm | tok/s | speedup vs plain (min..max) | tau | drafted per step | identical |")
    print("|---|---|---|---|---|---|---|")
    load = MachineLoad().start()
    for wl in args.workloads.split(","):
        prompts = load_workload(wl, limit=args.limit)
        rows: dict[str, list[tuple[float, float, float, bool]]] = {n: [] for n in engines}
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                order = list(engines.items())
                r = (rep * len(prompts) + i) % len(order)
                outs, speed = {}, {}
                for name, e in order[r:] + order[:r]:
                    t0 = time.perf_counter()
                    o = e.chat([list(p.messages)], sp, use_tqdm=False)[0]
                    speed[name] = len(o.token_ids) / (time.perf_counter() - t0)
                    outs[name] = (o.token_ids, o.stats)
                for name, (ids, st) in outs.items():
                    rows[name].append((speed[name], st.get("mean_acceptance_length", 1.0),
                                       st.get("num_draft_tokens", 0) / max(1, st.get("steps", 1)),
                                       ids == outs["plain"][0]))
        for name, rs in rows.items():
            ratio = [a[0] / b[0] for a, b in zip(rs, rows["plain"])]
            print(f"| {wl} | {name} | {statistics.median(x[0] for x in rs):.1f} | x{statistics.median(ratio):.2f} "
                  f"({min(ratio):.2f}..{max(ratio):.2f}) | {statistics.fmean(x[1] for x in rs):.2f} | "
                  f"{statistics.fmean(x[2] for x in rs):.2f} | {sum(x[3] for x in rs)}/{len(rs)} |", flush=True)
    print(f"\n{load.stop().describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
