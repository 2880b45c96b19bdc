"""n-gram drafts with hindsight-calibrated confidences under dspark, against the same policy without them, goodput
and static K = 3.

Since 2026-12-03 the n-gram drafter gives each draft position a confidence (drafters/hindsight.py: the survival
of drafts whose tail match had the same length, scored against the tokens the requests committed), dspark keeps
the best prefix of its ordering instead of stopping at the first drop, and drafts a confident drafter's whole block
where that costs next to nothing. The arms:
  plain             - speculation off (the baseline);
  static K=3        - every step drafts and verifies 3 tokens;
  goodput           - SmartSpec over the i.i.d. acceptance estimate, K up to 8;
  dspark            - the default: confidences, best prefix, K up to 8;
  dspark, no conf.  - the same policy with the drafts' confidences dropped (the online estimate decides);
  dspark, 1st drop  - confidences, but DSpark's stop at the first drop.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`,
the first `--limit` prompts of each shipped workload, `--repeats` repeats, the arms interleaved (order rotated per
prompt and repeat). Metric: output tok/s of one stream, prefill included. Baseline: plain decoding on the same
prompts in the same repeat: `pooled` is all tokens / all seconds of the arm over the workload's prompts divided by
plain's, per repeat; `per prompt` is the median (min..max) of the per-prompt ratios. tau = tokens per target
forward; drafted = draft tokens verified per step; identity: every arm's output against plain's.

    python benchmarks/ngram_confidence.py --limit 10 --repeats 2      (about 8 minutes on a 2-core CPU)
"""

from __future__ import annotations

import argparse
import statistics
import time

from verispec import LLM, SamplingParams
from verispec.bench.load import MachineLoad
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters.base import Draft


def _without_confidences(e: LLM) -> None:
    """Every drafter of this engine proposes the same tokens with no confidences (and says it gives none)."""
    new = e.engine.drafters.new

    def make(*a, **kw):
        d = new(*a, **kw)
        propose, d.gives_confidence = d.propose, False
        d.propose = lambda ctx, k: Draft(propose(ctx, k).tokens)
        return d

    e.engine.drafters.new = make


def arms(base: LLM, k: int) -> dict[str, LLM]:
    def spec(sched: str) -> LLM:
        e = base.with_speculation({"method": "ngram", "num_speculative_tokens": k})
        e.configure_engine(scheduler=sched)
        return e

    out = {"plain": base,
           "static K=3": base.with_speculation({"method": "ngram", "num_speculative_tokens": 3, "adaptive": False}),
           "goodput": spec("goodput"), "dspark": spec("dspark"), "dspark, no conf.": spec("dspark"),
           "dspark, 1st drop": spec("dspark")}
    _without_confidences(out["dspark, no conf."])
    out["dspark, 1st drop"].engine.policy.first_drop = True
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=10)
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
    print("\n| workload | arm | pooled, per repeat | per prompt (min..max) | tau | drafted per step | identical |")
    print("|---|---|---|---|---|---|---|")
    load = MachineLoad().start()
    for wl in args.workloads.split(","):
        prompts = load_workload(wl, limit=args.limit)
        # per arm: (repeat, tokens, seconds, tau, drafted per step, identical to plain)
        rows: dict[str, list[tuple[int, int, float, float, float, bool]]] = {n: [] for n in engines}
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                order = list(engines.items())
                r = (rep * len(prompts) + i) % len(order)
                outs = {}
                for name, e in order[r:] + order[:r]:
                    t0 = time.perf_counter()
                    o = e.chat([list(p.messages)], sp, use_tqdm=False)[0]
                    outs[name] = (o.token_ids, o.stats, time.perf_counter() - t0)
                for name, (ids, st, dt) in outs.items():
                    rows[name].append((rep, len(ids), dt, st.get("mean_acceptance_length", 1.0),
                                       st.get("num_draft_tokens", 0) / max(1, st.get("steps", 1)),
                                       ids == outs["plain"][0]))
        plain = rows["plain"]
        for name, rs in rows.items():
            pooled = []
            for rep in range(args.repeats):
                mine = [x for x in rs if x[0] == rep]
                theirs = [x for x in plain if x[0] == rep]
                pooled.append(sum(x[1] for x in mine) / sum(x[2] for x in mine)
                              / (sum(x[1] for x in theirs) / sum(x[2] for x in theirs)))
            ratio = [(a[1] / a[2]) / (b[1] / b[2]) for a, b in zip(rs, plain)]
            print(f"| {wl} | {name} | {' / '.join(f'x{x:.2f}' for x in pooled)} | x{statistics.median(ratio):.2f} "
                  f"({min(ratio):.2f}..{max(ratio):.2f}) | {statistics.fmean(x[3] for x in rs):.2f} | "
                  f"{statistics.fmean(x[4] for x in rs):.2f} | {sum(x[5] for x in rs)}/{len(rs)} |", flush=True)
    print(f"\n{load.stop().describe()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
