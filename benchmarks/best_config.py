"""The issue's speculation bar, measured as it is worded: the best speculative configuration of the model-free
drafters against the fastest plain configuration, on the structured, template and markdown workloads.

The arms: plain decoding on the path `dtype="auto"` picks (the fastest plain configuration: it is chosen by
measuring the paths), then n-gram and suffix drafting, each under the default policy (dspark, K up to `--k`) and
as a static block of K = 3 drafted tokens every step (the best fixed block on the CPUs measured so far). Every
output is compared with plain decoding's (greedy: identical, token for token).

Conditions (MEASURE.md): concurrency 1, in process, the default model on `dtype auto`; greedy, `--max-tokens`, the
first `--limit` prompts of each workload (`--limit 30`: all of them), `--repeats` repeats, the arms interleaved
(order rotated per prompt and repeat), the drafters' shared state emptied before each repeat. Metric: output tok/s
of one stream, prefill included (`pooled` per repeat: all tokens / all seconds of the arm over the workload,
divided by plain's; `decode only` leaves each request's prefill out); baseline: plain decoding on the same
prompts in the same repeat.

    python benchmarks/best_config.py --limit 30 --repeats 2      (about 6 minutes on a 2-core CPU)
    python benchmarks/best_config.py --workloads code,chat --limit 10
"""

from __future__ import annotations

from verispec import LLM
from verispec.bench.interleave import compare_arms

STRUCTURED = "json_records,templates,markdown"


def arms(base: LLM, k: int) -> dict[str, LLM]:
    out: dict[str, LLM] = {"plain": base}
    for method in ("ngram", "suffix"):
        out[f"{method}, dspark"] = base.with_speculation({"method": method, "num_speculative_tokens": k})
        out[f"{method}, static K=3"] = base.with_speculation({"method": method, "num_speculative_tokens": 3,
                                                              "adaptive": False})
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--workloads" not in argv:
        argv += ["--workloads", STRUCTURED]
    return compare_arms(__doc__, arms, argv, default_limit=10)


if __name__ == "__main__":
    raise SystemExit(main())
