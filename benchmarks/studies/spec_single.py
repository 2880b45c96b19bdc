"""Single-stream speculative decoding on the shipped agent workloads: plain vs each drafter.

Conditions (MEASURE.md): concurrency 1; metric = output tok/s of one stream (whole request, prefill included),
plus tau, the step-time split and greedy identity; baseline = speculation off (method none), same target, same
dtype, same prompts, in the same run. Methods run interleaved (the order rotates per prompt and repeat) and every
ratio is method tok/s / plain tok/s on the same prompt and repeat; the table gives the median and the min..max.

    python benchmarks/studies/spec_single.py --dtypes bfloat16,float32 --limit 4 --max-tokens 128 --repeats 2
    python benchmarks/studies/spec_single.py --dtypes auto --methods eagle3,eagle3+tree --k 4 --fixed-k \
        --versus eagle3+tree/eagle3 --workloads json_records,code --limit 4 --max-tokens 96 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

from verispec import LLM, SamplingParams
from verispec.bench.single import SPLIT, method_spec
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.config import LEARNED_METHODS
from verispec.check.identity import compare_greedy

METHODS = {
    "ngram": {"method": "ngram", "num_speculative_tokens": 8},
    "suffix": {"method": "suffix", "num_speculative_tokens": 8},
}


SHAPES = {"chain": False, "tree": True, "auto": "auto"}


def run(args) -> dict:
    results: dict = {}
    for dtype in args.dtypes.split(","):
        base = LLM(args.model, dtype=dtype, device="cpu", max_model_len=2048, progress=False)
        engines = {"none": base}
        for name in args.methods.split(","):
            method, _, shape = name.partition("+")  # NAME+tree / NAME+auto: draft trees, or trees vs chains per step
            if method in METHODS:
                spec = dict(METHODS[method])
            elif ":" in method or method in LEARNED_METHODS:  # eagle3[:DIR], dflash / dspark[:DIR], draft_model:DIR
                spec = method_spec(method, args.k)
            else:
                spec = {"method": "draft_model", "model": method, "num_speculative_tokens": 4}
            if args.fixed_k:
                spec["adaptive"] = False
            if shape:
                if shape not in SHAPES:
                    raise SystemExit(f"{name}: the shape after + is one of {', '.join(SHAPES)}")
                spec["draft_tree"] = SHAPES[shape]
            engines[name] = base.with_speculation(spec)
        warm = {"prompt_token_ids": base.tokenizer("Hello", add_special_tokens=False)["input_ids"]}
        for e in engines.values():
            if e.spec.method != "none":
                _ = e.costs  # profile once, outside the timed runs
            # a learned drafter loads at its first request: that first request, not a timed one
            e.generate(warm, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
        for wl in args.workloads.split(","):
            prompts = load_workload(wl, limit=args.limit)
            rows: dict[str, list] = defaultdict(list)
            for r in range(args.repeats):
                # the suffix cache learns from earlier outputs; a repeat of the same greedy prompt would find its own
                # output there and overstate the gain, so each repeat starts with an empty shared cache
                for e in engines.values():
                    e.drafters.reset_shared()
                for i, wp in enumerate(prompts):
                    text = base.apply_chat_template(list(wp.messages))
                    ids = base.tokenizer(text, add_special_tokens=False)["input_ids"]
                    params = SamplingParams(temperature=0, max_tokens=min(wp.max_tokens, args.max_tokens))
                    names = list(engines)
                    shift = (r * len(prompts) + i) % len(names)
                    got = {}
                    for name in names[shift:] + names[:shift]:
                        got[name] = engines[name].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                    plain = got["none"]
                    for name, out in got.items():
                        div = None if name == "none" else compare_greedy(base.model, ids, plain.token_ids,
                                                                          out.token_ids)
                        rows[name].append({
                            "ratio": out.stats["tok_per_s"] / plain.stats["tok_per_s"],
                            "tok_per_s": out.stats["tok_per_s"],
                            "tau": out.stats["mean_acceptance_length"],
                            "identical": div is None,
                            "divergence": None if div is None else str(div),
                            "split": {k: out.stats[k] for k in SPLIT},
                        })
                    print(".", end="", flush=True, file=sys.stderr)
            results[(dtype, wl)] = rows
            print(file=sys.stderr)
            report_block(dtype, wl, rows)
            for pair in filter(None, (args.versus or "").split(",")):
                report_pair(dtype, wl, rows, *pair.split("/"))
    return results


def report_block(dtype: str, wl: str, rows: dict) -> None:
    for name, rs in rows.items():
        ratios = [x["ratio"] for x in rs]
        split = {k: sum(x["split"][k] for x in rs) for k in SPLIT}
        total = sum(split.values()) or 1.0
        ident = sum(x["identical"] for x in rs) / len(rs)
        print(f"| {dtype} | {wl} | {name} | {statistics.median(x['tok_per_s'] for x in rs):.1f} | "
              f"x{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}) | "
              f"{statistics.median(x['tau'] for x in rs):.2f} | "
              + " / ".join(f"{100 * v / total:.0f}" for v in split.values())
              + f" | {100 * ident:.0f}% |", flush=True)
        for x in rs:
            if x["divergence"]:
                print(f"    {name}: {x['divergence']}", flush=True)


def report_pair(dtype: str, wl: str, rows: dict, a: str, b: str) -> None:
    """Method a against method b on the same prompts and repeats (each run paired with b's run beside it)."""
    if a not in rows or b not in rows:
        raise SystemExit(f"--versus {a}/{b}: both must be among --methods")
    ratios = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(rows[a], rows[b])]
    print(f"    {dtype} {wl}: {a} / {b} = x{statistics.median(ratios):.2f} ({min(ratios):.2f}..{max(ratios):.2f}), "
          f"{len(ratios)} paired runs", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--methods", default="ngram,suffix",
                    help="ngram, suffix, a draft model path, or eagle3 / dflash / dspark (the shipped drafter) or "
                         "eagle3:DIR / dflash:DIR / dspark:DIR; +tree or +auto after a name: draft trees, or trees "
                         "vs chains chosen per step (draft_tree auto)")
    ap.add_argument("--k", type=int, default=7, help="most draft tokens per step for learned drafters")
    ap.add_argument("--fixed-k", action="store_true",
                    help="verify k drafted tokens every step (adaptive: false) instead of the scheduler's choice")
    ap.add_argument("--versus", help="A/B[,C/D]: also report method A's tok/s over method B's on the same prompt "
                                     "and repeat, e.g. eagle3+tree/eagle3")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=4, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", help="write raw per-run records here")
    args = ap.parse_args()
    print("| dtype | workload | method | tok/s (median) | speedup vs plain, median (min..max) | tau | "
          "draft / forward / verify / sched / state % | identical to plain |")
    print("|---|---|---|---|---|---|---|---|")
    results = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{k[0]}/{k[1]}": v for k, v in results.items()}, f, indent=1)


if __name__ == "__main__":
    main()
