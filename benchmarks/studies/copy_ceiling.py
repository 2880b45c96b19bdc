"""What could any drafter that copies from the context gain on Spec-Bench, category by category?

Issue 65 asks x1.8 end to end on extraction, summarization, rag and translation and x1.3 on the median category
(128 tokens, c1, wall clock with prefill, default configuration against speculation off). This study bounds what a
copying drafter (n-gram, suffix, trees of either) could reach with the default model, from its own greedy output
(verispec/bench/ceiling.py): per step the longest run of the output that occurs earlier in prompt + output (at most
k), verified by a scheduler that knows the run, the forward's time at run + 1 tokens from this machine's profile,
drafting free; then the end-to-end ceiling with the plain request's time to its first token, which speculation
does not change, and the ceiling of any drafter at all (decoding infinitely fast).

Conditions (MEASURE.md):
  - Model: the default model and weight path (dtype auto), CPU, concurrency 1, in process; prompts: the first
    --per-category questions of each Spec-Bench category (first turn, chat template), greedy, --max-tokens.
  - Metric: per category, tau (tokens per step) of the n-gram drafter with every draft verified, of the best of
    its lookup's candidates each step (a tree of all of them) and of the copy ceiling; the end-to-end speedup over
    plain decoding of each, its steps verified by a scheduler that knows their runs (a step's forward at run + 1
    tokens), and of any drafter at all (decoding infinitely fast).
  - Baseline: plain greedy decoding of the same prompts (its time to first token and decode time, median of
    --repeats runs per prompt, after one warm-up request).

    python benchmarks/studies/copy_ceiling.py question.jsonl --per-category 5 --k 8
"""

from __future__ import annotations

import argparse
import math
import statistics

from verispec import LLM, SamplingParams
from verispec.bench.ceiling import copy_steps, decode_ceiling, drafter_run, end_to_end_ceiling, lookup_run
from verispec.bench.spec_bench import load_spec_bench
from verispec.drafters.ngram import NgramDrafter
from verispec.engine.costs import StepCosts
from verispec.engine.profile import profile_costs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("questions", help="Spec-Bench's data/spec_bench/question.jsonl")
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=8, help="the longest draft")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    llm = LLM(progress=False)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    llm.chat([{"role": "user", "content": "Hi"}], sp, use_tqdm=False)  # warm-up
    costs = StepCosts(profile_costs(llm.model, tuple(range(1, args.k + 2)), repeats=25))
    print("step costs (ms, after 128 tokens): " + ", ".join(f"M={m} {1e3 * costs(m):.2f}"
                                                           for m in range(1, args.k + 2)))
    rows = []
    for cat, prompts in load_spec_bench(args.questions, args.per_category, max_tokens=args.max_tokens).items():
        first = dec = 0.0
        tokens = prompt_tokens = 0
        runs_all: list[int] = []  # the copy ceiling's steps, then the best lookup candidate's, then n-gram's
        lookup_all: list[int] = []
        ngram_all: list[int] = []
        for wp in prompts:
            outs = [llm.chat(list(wp.messages), sp, use_tqdm=False)[0] for _ in range(args.repeats)]
            prompt, output = list(outs[0].prompt_token_ids), list(outs[0].outputs[0].token_ids)
            first += statistics.median(o.stats["ttft_s"] for o in outs)
            dec += statistics.median(o.stats["e2e_s"] - o.stats["ttft_s"] for o in outs)
            runs = copy_steps(prompt + output[:1], output[1:], args.k)  # the first token: prefill, in every arm
            runs_all += runs
            tokens, prompt_tokens = tokens + len(output) - 1, prompt_tokens + len(prompt)
            ngram_all += copy_steps(prompt + output[:1], output[1:], args.k, drafter_run(NgramDrafter()))
            lookup_all += copy_steps(prompt + output[:1], output[1:], args.k, lookup_run)
        speeds = [decode_ceiling(r, costs) for r in (ngram_all, lookup_all, runs_all)]
        rows.append((cat, prompt_tokens / len(prompts), first / (first + dec),
                     *(tokens / len(r) for r in (ngram_all, lookup_all, runs_all)),
                     *(end_to_end_ceiling(first, dec, s) for s in speeds), end_to_end_ceiling(first, dec, math.inf)))
    print(f"\ncopy ceiling at k = {args.k}; {args.per_category} prompts a category; {args.max_tokens} tokens, greedy\n")
    print("| category | prompt tokens (mean) | first token / plain request | tau: n-gram, every draft verified | "
          "tau: best lookup candidate | tau: copy ceiling | end to end: n-gram | end to end: best lookup candidate | "
          "end to end: copy ceiling | end to end: any drafter |\n|---|---|---|---|---|---|---|---|---|---|")
    for cat, p, share, *r in rows:
        print(f"| {cat} | {p:.0f} | {100 * share:.0f}% | " + " | ".join(f"{t:.2f}" for t in r[:3]) + " | "
              + " | ".join(f"x{e:.2f}" for e in r[3:]) + " |")
    print("\nmedian category, end to end: " + ", ".join(f"x{statistics.median(r[i] for r in rows):.2f} ({name})"
                                                       for i, name in ((6, "n-gram"), (7, "best lookup candidate"),
                                                                       (8, "copy ceiling"))))


if __name__ == "__main__":
    main()
