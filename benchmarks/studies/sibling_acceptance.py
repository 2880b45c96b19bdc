"""At T > 0, how often is a tree's j-th drawn sibling accepted, and what does that allow a tree of N nodes?

Sampled trees draw a node's children from the drafter's q without replacement and verify them with the multi-draft
rule (drafters/tree_growth.py, execution/tree_verify.py). The first child is accepted with 1 - TV(p, q), as a chain's
token is; each later one only against what the rejected ones left. This script measures those rates for EAGLE-3's
first draft along the target's own sampled continuations, then the best tree for rates that do not depend on the
position (Sequoia's: a node of sibling rank j below an accepted parent is accepted with b_j = a_j x the product of
(1 - a_i) for i < j; a tree's expected committed tokens are 1 + the sum over its nodes of the product of b along the
path, and the N nodes of largest product form the best tree) against the chain of N rank-0 nodes.

Conditions (MEASURE.md):
  - Model: the default model (--dtype float32), CPU, the shipped EAGLE-3 head; prompts: the first --limit of each
    shipped workload, chat template applied; the target's continuation sampled at --temperature (seed = the prompt's
    index), --max-tokens; at each position the target's p and the head's q (its first draft step, fed the target's
    features of the committed positions).
  - Metric: a_j = P(the j-th drawn sibling is accepted | the earlier ones rejected), Monte Carlo with --sims draws of
    4 siblings per position through the verifier's rule; the modelled tau of the best tree and of the chain.
  - Baseline: the chain at the same N, under the same rates. No timing.

    python benchmarks/studies/sibling_acceptance.py --limit 4 --max-tokens 96 --sims 16
"""

from __future__ import annotations

import heapq

import torch

from verispec import SamplingParams
from verispec.bench.common import eagle3_study, load_eagle3
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.execution.features import select
from verispec.drafters.tree_growth import TREE_TOPK, draw_distinct
from verispec.sampling import target_probs
from verispec.execution.verify import residual



def sibling_rates(p: torch.Tensor, q: torch.Tensor, sims: int, g: torch.Generator) -> tuple[list[int], list[int]]:
    """p, q: [V]. Per sibling rank: (accepted, tried) over `sims` rounds of TREE_TOPK siblings drawn from q without
    replacement and tried in order against p and what each rejection leaves (the verifier's rule)."""
    accepted, tried = [0] * TREE_TOPK, [0] * TREE_TOPK
    for _ in range(sims):
        toks, rows = draw_distinct(q, TREE_TOPK, g)
        r = p
        for j, (x, row) in enumerate(zip(toks, rows)):
            tried[j] += 1
            if float(torch.rand((), generator=g, dtype=torch.float64)) * float(row[x]) <= float(r[x]):
                accepted[j] += 1
                break
            r = residual(r, row, x)
    return accepted, tried


def modelled_tau(a: list[float], n: int) -> tuple[float, float]:
    """(best tree, chain) of n nodes under per-rank rates a: expected committed tokens per step."""
    b, left = [], 1.0
    for x in a:
        b.append(left * x)
        left *= 1.0 - x
    heap = [(-bj, j) for j, bj in enumerate(b)]  # (-path product, tie order)
    heapq.heapify(heap)
    total, order = 0.0, len(b)
    for _ in range(n):
        v, _ = heapq.heappop(heap)
        total += -v
        for bj in b:  # the popped node's children
            heapq.heappush(heap, (v * bj, order))
            order += 1
    return 1.0 + total, 1.0 + sum(b[0] ** d for d in range(1, n + 1))


def main(argv=None) -> int:
    ap = eagle3_study(__doc__, 96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--sims", type=int, default=16, help="Monte Carlo rounds of siblings per position")
    ap.add_argument("--nodes", default="4,7,16", help="tree sizes to model")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    args = ap.parse_args(argv)
    llm, head = load_eagle3(args)
    nodes = [int(n) for n in args.nodes.split(",")]
    g = torch.Generator().manual_seed(0)
    T = args.temperature
    print(f"\n## Drawn siblings at T = {T}: EAGLE-3 on {args.model} ({args.dtype}), {args.limit} prompts per workload, "
          f"{args.max_tokens} tokens, {args.sims} rounds per position\n")
    print("| workload | positions | a_1 .. a_4 | 1 - TV | " + " | ".join(f"{n} nodes: chain / best tree" for n in nodes)
          + " |")
    print("|---|---|---|---|" + "---|" * len(nodes))
    for w in args.workloads.split(","):
        prompts = [llm.tokenizer(llm.apply_chat_template(list(p.messages)), add_special_tokens=False)["input_ids"]
                   for p in load_workload(w)[: args.limit]]
        outs = llm.generate([{"prompt_token_ids": ids} for ids in prompts],
                            [SamplingParams(temperature=T, seed=i, max_tokens=args.max_tokens)
                             for i in range(len(prompts))], use_tqdm=False)
        accepted, tried, overlap, positions = [0] * TREE_TOPK, [0] * TREE_TOPK, 0.0, 0
        for ids, o in zip(prompts, outs):
            seq = ids + list(o.token_ids)
            _, _, fwd = llm.model.prefill_fresh(seq, logits_indices=list(range(len(ids) - 1, len(seq) - 1)),
                                                capture_layers=tuple(head.feature_layers), return_last_hidden=True)
            feats = select(fwd.hidden, head.feature_layers)
            P = target_probs(fwd.logits.float(), T)  # [n_out, V]: the target's distribution of each output token
            d = Eagle3Drafter(head, SamplingParams(temperature=T, seed=0), max_len=len(seq) + 8)
            for t in range(len(o.token_ids)):
                ctx = seq[: len(ids) + t]
                d.add_features(feats[d.n_feat : len(ctx) - 1])
                q = d.propose(ctx, 1).probs[0]  # [V] the head's first draft distribution
                acc, tr = sibling_rates(P[t], q, args.sims, g)
                accepted = [x + y for x, y in zip(accepted, acc)]
                tried = [x + y for x, y in zip(tried, tr)]
                overlap += float(torch.minimum(P[t], q).sum())
                positions += 1
            d.release()
        a = [x / y if y else 0.0 for x, y in zip(accepted, tried)]
        cells = []
        for n in nodes:
            tree, chain = modelled_tau(a, n)
            cells.append(f"{chain:.2f} / {tree:.2f} (x{tree / chain:.2f})")
        print(f"| {w} | {positions} | {', '.join(f'{x:.2f}' for x in a)} | {overlap / positions:.2f} | "
              + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
