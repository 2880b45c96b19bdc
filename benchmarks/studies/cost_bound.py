"""The cost model's well-measured points against the line alone: what the adaptive policies make of n-gram drafts.

`MeasuredStepCosts` reads the engine's measured forwards as a least-squares line; since 2026-12-03 a token count
measured `min_count` times also bounds it from below (engine/costs.py). This runs the same policy both ways, side
by side, with plain decoding and static K = 3 as references.

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`,
the first `--limit` prompts of each shipped workload, `--repeats` repeats, the arms interleaved (order rotated per
prompt and repeat). Metric: output tok/s of one stream, prefill included; tau = tokens per target forward; drafted
= draft tokens verified per step; `decode only` pools the tokens after each request's first over the time after
it (prefill left out). Baseline: plain decoding on the same prompt and repeat (ratio per pair, median
and min..max); identity: every arm's output against plain's.

    python benchmarks/studies/cost_bound.py --limit 4 --repeats 2      (about 5 minutes on a 2-core CPU)
"""

from __future__ import annotations

from verispec import LLM
from verispec.bench.interleave import compare_arms

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
    return compare_arms(__doc__, arms, argv, default_limit=4)


if __name__ == "__main__":
    raise SystemExit(main())
