"""DFlash 2's path selector against DFlash alone: greedy tau replayed exactly, and the selector's share of step time.

Conditions (MEASURE.md):
  - Model: the default model (--dtype, CPU); drafters: a DFlash checkpoint with a path selector (`verispec train
    selector`) and the same DFlash without it; prompts: the first --limit prompts of each shipped workload, chat
    template applied; the target's plain greedy continuation of each, --max-tokens.
  - tau: committed tokens per verification step, replayed on the recorded continuation exactly as in
    benchmarks/studies/tree_acceptance.py (a chain of k tokens per step; with --trees also trees of k nodes). Baseline: DFlash
    without the selector, same k, same continuations, same run.
  - Cost: one engine run per prompt with the selector at concurrency 1, static scheduler, k verified every step; the
    seconds spent in the selector (its lattice and walk) over the request's decode seconds, summed over prompts.
    Also the selector's parameter count and DSpark's serial head's beside it when --dspark names one.

    python benchmarks/studies/path_selector.py --drafter DIR_WITH_SELECTOR --dtype float32 --limit 4 --k 7 --trees
"""

from __future__ import annotations

import argparse
import time

from verispec.bench.replay import replay
from verispec import LLM, SamplingParams
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters import path_selector
from verispec.drafters.dflash import DFlashDrafter
from verispec.drafters.dflash import load as load_block
from verispec.execution.features import capture_forward, select
from verispec.drafters.shipped import resolve


class Timed:
    """Wraps a callable, summing the seconds spent in it."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.seconds += time.perf_counter() - t


def record(llm: LLM, limit: int, max_tokens: int) -> dict[str, list[tuple[list[int], list[int]]]]:
    runs = {}
    for w in WORKLOADS:
        prompts = [llm.tokenizer(llm.apply_chat_template(list(p.messages)), add_special_tokens=False)["input_ids"]
                   for p in load_workload(w)[:limit]]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
        runs[w] = [(ids, list(o.token_ids)) for ids, o in zip(prompts, outs)]
    return runs


def tau_table(llm: LLM, models: dict, runs: dict, ks: list[int], trees: bool) -> None:
    layers = next(iter(models.values())).cfg.feature_layers
    feats = {(w, i): select(capture_forward(llm.model, ids + out, layers).hidden, layers)
             for w, items in runs.items() for i, (ids, out) in enumerate(items)}
    print("| workload | k | shape | DFlash tau | DFlash 2 tau | ratio |")
    print("|---|---|---|---|---|---|")
    for w, items in runs.items():
        for k in ks:
            for tree in (False, True) if trees else (False,):
                tau = {}
                for name, m in models.items():
                    res = [replay(DFlashDrafter(m, SamplingParams(temperature=0)), ids, out, k, tree, feats[(w, i)])
                           for i, (ids, out) in enumerate(items)]
                    tau[name] = sum(r[0] for r in res) / sum(r[1] for r in res)
                print(f"| {w} | {k} | {'tree' if tree else 'chain'} | {tau['dflash']:.2f} | {tau['dflash2']:.2f} | "
                      f"x{tau['dflash2'] / tau['dflash']:.2f} |", flush=True)


def cost_share(llm: LLM, drafter: str, runs: dict, k: int) -> None:
    spec = llm.with_speculation({"method": "dflash", "model": drafter, "num_speculative_tokens": k,
                                 "adaptive": False})
    sel = spec.drafters.learned.selector
    lattice, walk = Timed(sel.lattice), Timed(path_selector.walk)
    sel.lattice = lattice
    import verispec.drafters.dflash as dfl

    dfl.walk = walk
    decode = 0.0
    try:
        for items in runs.values():
            for ids, out in items:
                o = spec.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=len(out)),
                                  use_tqdm=False)[0]
                decode += o.stats["e2e_s"] - o.stats["ttft_s"]
    finally:
        del sel.lattice
        dfl.walk = path_selector.walk
    spent = lattice.seconds + walk.seconds
    print(f"\nselector cost at k = {k}, concurrency 1: {spent:.2f} s of {decode:.1f} s decode "
          f"({100 * spent / decode:.2f}% of step time); parameters {sel.num_params():,}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--drafter", required=True, help="a DFlash checkpoint directory holding a path selector")
    ap.add_argument("--dspark", default="smollm2-135m-instruct-dspark", help="DSpark drafter whose serial head's "
                    "size is printed beside the selector's ('' to skip)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", default="4,7")
    ap.add_argument("--trees", action="store_true", help="also trees of k nodes, with and without the selector")
    ap.add_argument("--no-cost", action="store_true", help="skip the engine run that times the selector")
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", progress=False, scheduler="static")
    with2 = load_block(args.drafter, llm.model)
    if with2.selector is None:
        raise SystemExit(f"{args.drafter} holds no path selector (train one: verispec train selector)")
    alone = load_block(args.drafter, llm.model)
    alone.selector = None  # the same DFlash weights without the selector
    ks = [int(k) for k in args.k.split(",")]
    print(f"\n## DFlash 2 path selector: {args.model}, {args.dtype}, greedy, {args.limit} prompts per workload, "
          f"{args.max_tokens} max tokens\n")
    runs = record(llm, args.limit, args.max_tokens)
    tau_table(llm, {"dflash": alone, "dflash2": with2}, runs, ks, args.trees)
    if args.dspark:
        ds = load_block(resolve(args.dspark), llm.model)
        print(f"\nDSpark's serial head: {sum(p.numel() for p in ds.markov.parameters()):,} parameters")
    if not args.no_cost:
        cost_share(llm, args.drafter, runs, max(ks))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
