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

`--learned` adds the shipped learned drafters (EAGLE-3, DFlash, DSpark; K up to 4 under dspark, and EAGLE-3 with K
up to 7) for the issue's other two bars (none below x0.95 of plain on chat, EAGLE-3 at least x1.2 on code), and
EAGLE-3 attached but never asked to draft: what keeping a learned drafter beside the target costs when the policy
turns it off.

`--hybrid` runs EAGLE-3 and DFlash each behind n-gram and behind suffix drafting (`"hybrid"`), beside n-gram and
suffix alone, all under dspark.

    python benchmarks/studies/best_config.py --limit 30 --repeats 2      (about 6 minutes on a 2-core CPU)
    python benchmarks/studies/best_config.py --limit 30 --repeats 2 --max-tokens 0   # each prompt's own length (192 here)
    python benchmarks/studies/best_config.py --learned --workloads chat,code --limit 30 --repeats 2
    python benchmarks/studies/best_config.py --learned --workloads chat --phases   # + ms per step by phase, per arm
    python benchmarks/studies/best_config.py --learned --probe-shares 0.005 --limit 30 --repeats 2 --max-tokens 0
                                     # + each learned drafter with its probes priced at 0.5% of the plain steps
    python benchmarks/studies/best_config.py --hybrid --workloads json_records,templates,markdown,code,chat --limit 10
"""

from __future__ import annotations

import dataclasses
import functools
import sys

from verispec import LLM
from verispec.bench.interleave import compare_arms
from verispec.bench.single import method_spec

STRUCTURED = "json_records,templates,markdown"
LEARNED = ("eagle3", "dflash", "dspark")
LEARNED_K = 4  # most draft tokens per step for the learned drafters (their speed's best in earlier runs)
LEARNED_K_LONG = 7  # and for one more EAGLE-3 arm


def model_free_arms(base: LLM, k: int) -> dict[str, LLM]:
    out: dict[str, LLM] = {"plain": base}
    for method in ("ngram", "suffix"):
        out[f"{method}, dspark"] = base.with_speculation({"method": method, "num_speculative_tokens": k})
        out[f"{method}, static K=3"] = base.with_speculation({"method": method, "num_speculative_tokens": 3,
                                                              "adaptive": False})
    return out


def learned_arms(base: LLM, k: int, probe_shares: tuple[float, ...] = ()) -> dict[str, LLM]:
    out: dict[str, LLM] = {"plain": base}
    for method in LEARNED:
        out[method] = base.with_speculation(method_spec(method, LEARNED_K))
        for share in probe_shares:  # the same drafter, its probes priced at another share of the plain steps
            arm = out[f"{method}, probe share {share:g}"] = base.with_speculation(method_spec(method, LEARNED_K))
            arm.engine.config = dataclasses.replace(arm.engine.config, probe_share=share)
    # EAGLE-3 stops its own drafts where its confidence falls (stops_early): a longer K costs it only where the
    # drafts run on
    out[f"eagle3, K={LEARNED_K_LONG}"] = base.with_speculation(method_spec("eagle3", LEARNED_K_LONG))
    never = base.with_speculation(method_spec("eagle3", LEARNED_K))
    never.engine.policy.draft_lengths = lambda cands, base_tokens: [0] * len(cands)
    out["eagle3, never drafts"] = never
    return out


def hybrid_arms(base: LLM, k: int) -> dict[str, LLM]:
    """EAGLE-3 and DFlash each behind n-gram and behind suffix drafting (`hybrid`), beside the model-free drafters
    alone, all under dspark (K up to `--k`)."""
    out: dict[str, LLM] = {"plain": base}
    for free in ("ngram", "suffix"):
        out[f"{free}, dspark"] = base.with_speculation(method_spec(free, k))
    for method in ("eagle3", "dflash"):
        for free in ("ngram", "suffix"):
            out[f"{free}+{method}"] = base.with_speculation(method_spec(f"{free}+{method}", k))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    learned, hybrid = "--learned" in argv, "--hybrid" in argv
    argv = [a for a in argv if a not in ("--learned", "--hybrid")]
    shares: tuple[float, ...] = ()
    if "--probe-shares" in argv:
        i = argv.index("--probe-shares")
        shares = tuple(float(x) for x in argv[i + 1].split(","))
        del argv[i : i + 2]
        if not learned:
            raise SystemExit("--probe-shares adds learned drafters' arms: give it with --learned")
    if "--workloads" not in argv:
        argv += ["--workloads", "chat,code" if learned else STRUCTURED]
    arms = functools.partial(learned_arms, probe_shares=shares) if learned else model_free_arms
    if hybrid:
        if learned:
            raise SystemExit("--hybrid and --learned are two sets of arms: give one")
        arms = hybrid_arms
    return compare_arms(__doc__, arms, argv, default_limit=10)


if __name__ == "__main__":
    raise SystemExit(main())
