"""Trees against chains at the same number of verified positions: the drafters' tau, greedy, exactly.

Conditions (MEASURE.md):
  - Model: the default model (--dtype auto: the engine's measured path), CPU; prompts: the first --limit prompts
    of each shipped workload, chat template applied; the target's plain greedy continuation of each, --max-tokens.
  - Metric: tau = committed tokens per verification step, replayed exactly: under greedy verification a step
    commits the longest drafted path that follows the target's own continuation, plus one token, whatever else the
    draft holds. So every step is simulated on the recorded continuation: a chain of k tokens (`propose`) against
    a tree of at most k nodes and depth k (`propose_tree`: for ngram the recent earlier occurrences of the tail
    weighed by agreement, for suffix the most probable nodes of its tries, for eagle3 EAGLE-2's dynamic tree by
    the head's cumulative draft probability, for dflash / dspark the most probable paths through each block
    position's top-4 (DSpark's corrected by its Markov head per node), the learned ones fed the target's features of the committed positions from one
    from-scratch forward over the recorded sequence, as the engine feeds them from its verify forwards). Both verify at most k + 1 positions
    per step; the mean verified positions are reported beside tau. Suffix drafters of one workload share a cache
    that holds the earlier prompts' outputs, chains and trees each their own.
  - Baseline: the chain at the same k, same continuations, same run. No timing: what a tree costs on the target is
    the forward over its nodes, which equals the chain's at the same positions (tests/test_tree_attention.py).

    python benchmarks/studies/tree_acceptance.py --limit 8 --max-tokens 128 --k 2,4,8 --drafters ngram,suffix
    python benchmarks/studies/tree_acceptance.py --dtype float32 --limit 4 --max-tokens 128 --k 4,8 --drafters eagle3
    python benchmarks/studies/tree_acceptance.py --dtype float32 --limit 4 --max-tokens 128 --k 4,8 --drafters eagle3 \
        --widths 4       # EAGLE-2's growth (4 nodes expanded per depth) beside the default one, same run
    python benchmarks/studies/tree_acceptance.py --dtype float32 --limit 4 --max-tokens 128 --k 4,7 --drafters dflash,dspark
"""

from __future__ import annotations

import argparse
import statistics

from verispec import LLM, SamplingParams
from verispec.bench.replay import replay
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters.dflash import DFlashDrafter
from verispec.drafters.dflash import load as load_block
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.drafters.eagle3 import load as load_head
from verispec.execution.features import capture_forward, select
from verispec.drafters.ngram import NgramDrafter
from verispec.drafters.shipped import resolve
from verispec.drafters.suffix import SuffixCache, SuffixDrafter


LEARNED = ("eagle3", "dflash", "dspark")


def new_drafter(name: str, cache: SuffixCache, head=None):
    """A fresh per-request drafter; suffix drafters of one workload share `cache`, in which each replayed request's
    output is left when it ends (as the engine does on release), so later prompts draw on earlier outputs."""
    if name == "eagle3":
        return Eagle3Drafter(head, SamplingParams(temperature=0), max_len=4096)
    if name in LEARNED:
        return DFlashDrafter(head, SamplingParams(temperature=0))
    return NgramDrafter() if name == "ngram" else SuffixDrafter(cache)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--limit", type=int, default=4, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", default="2,4,8", help="draft positions per step (chain length = tree node budget)")
    ap.add_argument("--drafters", default="ngram,suffix", help="ngram, suffix, eagle3, dflash and / or dspark")
    ap.add_argument("--widths", default="", help="eagle3 only: also replay trees expanding this many nodes per "
                                                 "depth (comma-separated), beside the default growth")
    for m in LEARNED:
        ap.add_argument(f"--{m}", default=f"smollm2-135m-instruct-{m}", help=f"the {m} drafter (shipped name or dir)")
    args = ap.parse_args(argv)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", progress=False)
    ks = [int(k) for k in args.k.split(",")]
    widths = [int(w) for w in args.widths.split(",") if w]
    if widths and args.drafters != "eagle3":
        raise SystemExit("--widths applies to --drafters eagle3 alone")
    print(f"\n## Trees vs chains: {args.model}, greedy, {args.limit} prompts per workload, "
          f"{args.max_tokens} max tokens\n")
    extra = "".join(f" tree tau, {w} per depth | x chain |" for w in widths)
    print("| drafter | workload | k | chain tau | tree tau | tree / chain | verified per step (chain / tree) |" + extra)
    print("|---|---|---|---|---|---|---|" + "---|---|" * len(widths))
    runs = {}
    for w in WORKLOADS:
        prompts = [llm.tokenizer(llm.apply_chat_template(list(p.messages)), add_special_tokens=False)["input_ids"]
                   for p in load_workload(w)[: args.limit]]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        runs[w] = [(ids, list(o.token_ids)) for ids, o in zip(prompts, outs)]
    heads = {}  # learned drafter -> its module; features along each recorded sequence from one forward
    for name in (n for n in args.drafters.split(",") if n in LEARNED):
        path = resolve(getattr(args, name))
        heads[name] = load_head(path, llm.model) if name == "eagle3" else load_block(path, llm.model)
    feats = {}
    for name, head in heads.items():
        for w, items in runs.items():
            for ids, out in items:
                layers = head.feature_layers if name == "eagle3" else head.cfg.feature_layers
                feats[(name, w, len(ids), tuple(out))] = select(capture_forward(llm.model, ids + out, layers).hidden,
                                                                layers)
    for name in args.drafters.split(","):
        for w, items in runs.items():
            for k in ks:
                shapes = [(False, None), (True, None)] + [(True, width) for width in widths]  # (tree, width)
                res = {shape: [replay(new_drafter(name, cache, heads.get(name)), ids, out, k, shape[0],
                                      feats.get((name, w, len(ids), tuple(out))), shape[1])
                               for ids, out in items]
                       for shape in shapes for cache in [SuffixCache()]}  # each shape its own suffix cache
                tau = {shape: sum(r[0] for r in rs) / sum(r[1] for r in rs) for shape, rs in res.items()}
                ver = {shape: statistics.fmean(r[2] / r[1] for r in rs) for shape, rs in res.items()}
                chain, tree = tau[shapes[0]], tau[shapes[1]]
                more = "".join(f" {tau[s]:.2f} | x{tau[s] / chain:.2f} |" for s in shapes[2:])
                print(f"| {name} | {w} | {k} | {chain:.2f} | {tree:.2f} | x{tree / chain:.2f} | "
                      f"{ver[shapes[0]]:.1f} / {ver[shapes[1]]:.1f} |" + more, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
