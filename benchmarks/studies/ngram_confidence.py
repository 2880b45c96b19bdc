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
plain's, per repeat; `decode only` the same after each request's first token (prefill, which speculation
does not change, left out); `per prompt` is the median (min..max) of the per-prompt ratios. tau = tokens per target
forward; drafted = draft tokens verified per step; identity: every arm's output against plain's.

    python benchmarks/studies/ngram_confidence.py --limit 10 --repeats 2      (about 8 minutes on a 2-core CPU)
"""

from __future__ import annotations

from verispec import LLM
from verispec.bench.interleave import compare_arms
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
    return compare_arms(__doc__, arms, argv, default_limit=10)


if __name__ == "__main__":
    raise SystemExit(main())
