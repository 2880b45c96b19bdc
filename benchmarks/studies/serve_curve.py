"""Serving throughput of the engine against concurrency: speculation off vs static K vs goodput vs dspark.

Conditions (MEASURE.md): concurrency C in a closed loop (C requests decode at once; a finished one is replaced
from the pool until the pool is empty); metric = aggregate output tok/s (all output tokens of the level / wall
time of the level); baseline = speculation off (method none) at the same concurrency, same prompts, same run;
each ratio is the median of the per-repeat ratios (off and the policy paired within a repeat), with their range.
The prompts are the shipped workloads, mixed (C * --per-slot of them per level, round-robin over the sets),
greedy. At every level the policies run interleaved, in an order that rotates per repeat. Outputs are compared
with speculation off: identical or a near-tie divergence, else it is flagged.

    python benchmarks/studies/serve_curve.py --dtype bfloat16 --concurrency 1,4,16,32 --max-tokens 48 --repeats 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

from verispec import LLM
from verispec.bench.load import MachineLoad
from verispec.config import KV_CACHE_DTYPES
from verispec.bench.common import prompt_pool
from verispec.check.identity import compare_greedy


def run_level(llm: LLM, spec: dict | None, scheduler: str, conc: int, pool) -> dict:
    llm._set_speculation(spec)
    llm.configure_engine(max_num_seqs=conc, scheduler=scheduler)
    if llm.enable_prefix_caching:
        llm.reset_prefix_cache()  # only what this run's own requests share
    if spec is not None and scheduler != "static":
        _ = llm.costs  # profiled once per shape, outside the timed part
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": ids} for ids, _ in pool], [p for _, p in pool], use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.token_ids) for o in outs)
    drafted = sum(o.stats["num_draft_tokens"] for o in outs)
    accepted = sum(o.stats["num_accepted_tokens"] for o in outs)
    steps = sum(o.stats["steps"] for o in outs)
    return {"tok_per_s": tokens / wall, "wall_s": wall, "tokens": tokens, "outputs": [o.token_ids for o in outs],
            "tau": 1 + accepted / steps if steps else 1.0, "drafted": drafted}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto", help="auto (the engine default: the measured fastest path) or a dtype")
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--policies", default="static,goodput,dspark")
    ap.add_argument("--drafter", default="ngram", choices=["ngram", "suffix"])
    ap.add_argument("-k", "--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--per-slot", type=int, default=2, help="requests per level = concurrency * this (min 4)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the raw results here")
    ap.add_argument("--plot", default=None, help="write the curve as a PNG here")
    ap.add_argument("--enable-prefix-caching", action="store_true",
                    help="as `verispec serve` does by default; the cache is emptied before every run, so no run "
                         "reuses prompts another cached")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    args = ap.parse_args(argv)

    levels = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_model_len=1024, max_num_seqs=max(levels), progress=False,
              enable_prefix_caching=args.enable_prefix_caching, kv_cache_dtype=args.kv_cache_dtype)
    spec = {"method": args.drafter, "num_speculative_tokens": args.num_speculative_tokens}
    arms = [("off", None, "static")] + [(p, spec, p) for p in args.policies.split(",")]
    llm._set_speculation(spec)
    _ = llm.costs  # the step-cost table for the largest batch, reused by every level
    results: dict = defaultdict(lambda: defaultdict(list))
    load = MachineLoad().start()
    for conc in levels:
        pool = prompt_pool(llm, max(4, conc * args.per_slot), args.max_tokens)
        run_level(llm, None, "static", conc, pool[: min(conc, 4)])  # warm-up at this batch shape
        for r in range(args.repeats):
            order = arms[r % len(arms):] + arms[: r % len(arms)]
            got = {name: run_level(llm, sp, sched, conc, pool) for name, sp, sched in order}
            for name, res in got.items():
                ident = sum(a == b for a, b in zip(res["outputs"], got["off"]["outputs"]))
                near = sum(a != b and (d := compare_greedy(llm.model, ids, b, a)) is not None and d.near_tie
                           for a, b, (ids, _) in zip(res["outputs"], got["off"]["outputs"], pool))
                res["identical"] = f"{ident}/{len(pool)}" + (f" (+{near} near-tie)" if near else "")
                res["ratio"] = res["tok_per_s"] / got["off"]["tok_per_s"]
                results[conc][name].append({k: v for k, v in res.items() if k != "outputs"})
            print(f"C={conc} repeat {r}: " + ", ".join(f"{n} {got[n]['tok_per_s']:.1f}" for n, _, _ in arms),
                  file=sys.stderr, flush=True)

    load.stop()
    extras = "".join([", prefix caching" if args.enable_prefix_caching else "",
                      f", {args.kv_cache_dtype} KV" if args.kv_cache_dtype != "auto" else ""])
    print(f"\n## Serving curve: {args.model}, {args.dtype}{extras}, {args.drafter} drafter, "
          f"K={args.num_speculative_tokens}, greedy, {args.max_tokens} max tokens, shipped workloads mixed, "
          f"{args.repeats} repeat(s)\n\n"
          f"{load.describe()}\n")
    print("| concurrency | " + " | ".join(f"{n} tok/s" for n, _, _ in arms) + " | "
          + " | ".join(f"{n} / off" for n, _, _ in arms[1:]) + " | tau (" + ", ".join(n for n, _, _ in arms[1:])
          + ") | identical to off |")
    print("|" + "---|" * (2 + 2 * len(arms)))
    for conc in levels:
        row = results[conc]
        med = {n: statistics.median(x["tok_per_s"] for x in row[n]) for n, _, _ in arms}
        ratios = {n: _spread([x["ratio"] for x in row[n]]) for n, _, _ in arms[1:]}
        taus = ", ".join(f"{statistics.median(x['tau'] for x in row[n]):.2f}" for n, _, _ in arms[1:])
        ident = "; ".join(f"{n} {row[n][-1]['identical']}" for n, _, _ in arms[1:])
        print(f"| {conc} | " + " | ".join(f"{med[n]:.1f}" for n, _, _ in arms) + " | "
              + " | ".join(ratios[n] for n, _, _ in arms[1:]) + f" | {taus} | {ident} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({str(c): v for c, v in results.items()}, f, indent=1)
    if args.plot:
        plot(results, levels, [n for n, _, _ in arms], args)
    return 0


def _spread(ratios: list[float]) -> str:
    """The median of the paired per-repeat ratios, with their range beside it when there are several (MEASURE.md:
    median and spread over repeats)."""
    med = f"x{statistics.median(ratios):.2f}"
    return med if len(ratios) < 2 else f"{med} ({min(ratios):.2f}..{max(ratios):.2f})"


def plot(results, levels, names, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in names:
        ax.plot(levels, [statistics.median(x["tok_per_s"] for x in results[c][n]) for c in levels], marker="o", label=n)
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (closed loop)")
    ax.set_ylabel("aggregate output tok/s")
    ax.set_title(f"{args.model} {args.dtype}, {args.drafter} K={args.num_speculative_tokens}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
