"""Is a tree's gain over its chain bounded by the drafter? EAGLE-3's draft probabilities against greedy outcomes.

EAGLE-2 keeps the nodes with the highest cumulative draft probability. If a node's draft probability (given its
parent) is the chance the target accepts it once its parent is accepted, that choice maximises the expected
committed tokens of all trees built from the drafter's candidates, and 1 + the sum of the kept nodes' cumulative
probabilities predicts a step's committed tokens. This script measures both:

  - Calibration: every grown node whose parent lies on the target's path was tested by the target; its draft
    probability against how often it was accepted, by sibling rank (0: the drafter's top token), binned, with the
    expected calibration error (ECE: the count-weighted mean |probability - accepted rate| over the bins).
  - Gain: from the same contexts, the tree of `k` nodes and the chain of `k` top-1 tokens (the tree's own rank-0
    path): committed tokens per step measured (exactly, on the target's recorded greedy continuation) and predicted
    from the draft probabilities, and the tree / chain ratio of each. Where the two ratios agree and the drafter is
    calibrated, a larger gain needs a drafter with more of the target's tokens among its alternatives, not another
    tree.

Conditions (MEASURE.md):
  - Model: the default model (--dtype float32 by default, so the replay matches fp32 decoding), CPU; the shipped
    EAGLE-3 head; prompts: the first --limit of each shipped workload, chat template applied; the target's greedy
    continuation, --max-tokens; the head fed the target's features of the committed positions from one forward.
  - Metric: committed tokens per step (tau); the tree advances the replay, the chain is scored on the same contexts
    (paired). Greedy only: at T > 0 what is accepted depends on the draws (see tree_sampled.py).
  - Baseline: the chain at the same k. No timing.

    python benchmarks/studies/tree_calibration.py --limit 4 --max-tokens 128 --k 4,8,16
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

from verispec import SamplingParams
from verispec.bench.common import eagle3_study, load_eagle3
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.execution.features import capture_forward, select

BINS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)


def replay_step(drafter: Eagle3Drafter, context: list[int], future: list[int], k: int):
    """One step from `context`, `future` the target's recorded continuation after it. Returns the grown nodes the
    target tested ([(draft probability given the parent, sibling rank, accepted)]), the tree's and the chain's
    accepted draft tokens, and their predicted committed tokens (1 + the kept nodes' cumulative probabilities)."""
    g = drafter._grow(context, k, k)
    keep = g.kept(k)  # the nodes Growth.best makes the tree of
    kids: dict[int, list[int]] = defaultdict(list)
    for i, par in enumerate(g.parent):
        kids[par].append(i)  # in rank order (Growth adds a node's children best first)
    on_path = {-1: True}  # node -> its path is the target's continuation
    tested = []
    for i in range(len(g.token)):  # parents come before their children
        par = g.parent[i]
        on_path[i] = on_path[par] and g.depth[i] <= len(future) and g.token[i] == future[g.depth[i] - 1]
        if on_path[par]:
            tested.append((math.exp(g.score[i] - (g.score[par] if par >= 0 else 0.0)), kids[par].index(i),
                           on_path[i]))
    chain, node = [], -1  # the rank-0 path: the chain of the head's top-1 tokens
    while kids.get(node) and len(chain) < k:
        node = kids[node][0]
        chain.append(node)
    chain_acc = next((j for j, i in enumerate(chain) if not on_path[i]), len(chain))
    tree_acc = max((g.depth[i] for i in keep if on_path[i]), default=0)
    predicted = (1 + sum(math.exp(g.score[i]) for i in keep), 1 + sum(math.exp(g.score[i]) for i in chain))
    return tested, tree_acc, chain_acc, predicted


def replay(drafter: Eagle3Drafter, prompt: list[int], out: list[int], feats: torch.Tensor, k: int, acc: dict) -> None:
    """Replay one request, the tree committing; add to acc's lists."""
    t = 0
    while t < len(out):
        context = prompt + out[:t]
        drafter.add_features(feats[drafter.n_feat : len(context) - 1])
        tested, tree_acc, chain_acc, (p_tree, p_chain) = replay_step(drafter, context, out[t:], k)
        acc["tested"] += tested
        acc["tree"].append(tree_acc + 1)
        acc["chain"].append(chain_acc + 1)
        acc["p_tree"].append(p_tree)
        acc["p_chain"].append(p_chain)
        t += tree_acc + 1
    drafter.release()


def calibration_rows(tested: list[tuple[float, int, bool]]) -> list[str]:
    """Markdown rows: per sibling rank (0, 1, 2+), each bin's mean probability -> accepted rate (count), and ECE."""
    rows = []
    for rank, name in ((0, "0"), (1, "1"), (2, "2+")):
        sel = [(p, a) for p, r, a in tested if (r == rank if rank < 2 else r >= 2)]
        cells, err = [], 0.0
        for lo, hi in zip(BINS, BINS[1:]):
            b = [(p, a) for p, a in sel if lo <= p < hi]
            if not b:
                continue
            mp, ma = sum(p for p, _ in b) / len(b), sum(a for _, a in b) / len(b)
            err += len(b) * abs(mp - ma)
            cells.append(f"{mp:.2f} -> {ma:.2f} ({len(b)})")
        rows.append(f"| {name} | {len(sel)} | {err / max(1, len(sel)):.3f} | {'; '.join(cells)} |")
    return rows


def main(argv=None) -> int:
    ap = eagle3_study(__doc__, 128)
    ap.add_argument("--k", default="4,8,16", help="tree node budgets (= chain lengths)")
    args = ap.parse_args(argv)
    llm, head = load_eagle3(args)
    ks = [int(k) for k in args.k.split(",")]
    print(f"\n## Tree vs chain, measured and predicted from EAGLE-3's draft probabilities: {args.model} "
          f"({args.dtype}), greedy, {args.limit} prompts per workload, {args.max_tokens} max tokens\n")
    print("| workload | k | steps | chain tau | tree tau | tree / chain | predicted chain | predicted tree | "
          "predicted tree / chain |")
    print("|---|---|---|---|---|---|---|---|---|")
    tested_all: dict[int, list] = defaultdict(list)
    for w in WORKLOADS:
        prompts = [llm.tokenizer(llm.apply_chat_template(list(p.messages)), add_special_tokens=False)["input_ids"]
                   for p in load_workload(w)[: args.limit]]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            SamplingParams(temperature=0, max_tokens=args.max_tokens), use_tqdm=False)
        runs = []
        for ids, o in zip(prompts, outs):
            out = list(o.token_ids)
            runs.append((ids, out, select(capture_forward(llm.model, ids + out, head.feature_layers).hidden,
                                          head.feature_layers)))
        for k in ks:
            acc: dict[str, list] = defaultdict(list)
            for ids, out, feats in runs:
                replay(Eagle3Drafter(head, SamplingParams(temperature=0), max_len=4096), ids, out, feats, k, acc)
            tested_all[k] += acc["tested"]
            m = {key: sum(acc[key]) / len(acc[key]) for key in ("chain", "tree", "p_chain", "p_tree")}
            print(f"| {w} | {k} | {len(acc['tree'])} | {m['chain']:.2f} | {m['tree']:.2f} | "
                  f"x{m['tree'] / m['chain']:.2f} | {m['p_chain']:.2f} | {m['p_tree']:.2f} | "
                  f"x{m['p_tree'] / m['p_chain']:.2f} |", flush=True)
    for k in ks:
        print(f"\n### Calibration, k = {k}: nodes the target tested (parent accepted), all workloads\n")
        print("| sibling rank | nodes | ECE | mean draft probability -> accepted rate (nodes), by bin |")
        print("|---|---|---|---|")
        print("\n".join(calibration_rows(tested_all[k])))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
