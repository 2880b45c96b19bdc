"""Trees against chains at T = 1: tau of sampled speculative decoding through the engine, at the same verified positions.

At T > 0 a replay on a recorded continuation is not exact (what is accepted depends on the random draws), so this
runs the engine itself, which verifies trees with the multi-draft rule (SpecInfer's recursive rejection over siblings;
deterministic top-k siblings as point masses) and chains with the standard rule; both keep the target's distribution.

Conditions (MEASURE.md):
  - Model: the default model (--dtype auto: the engine's measured path), CPU; prompts: the first --limit prompts of
    each shipped workload, chat template applied; temperature --temperature, seed = the prompt's index (the same
    seeds for chains and trees), --max-tokens per request, all prompts of a workload in one batch (tau does not
    depend on batching), the static scheduler (every step drafts and verifies k), adaptivity off.
  - Metric: tau = 1 + accepted draft tokens / verification steps, summed over the workload's requests (MEASURE.md's
    mean acceptance length); the verified positions per step beside it.
  - Baseline: the chain at the same k (a tree holds at most k nodes), same prompts and seeds, same run. The draws
    differ between arms, so a tau ratio carries sampling noise: more prompts or tokens narrow it.

    python benchmarks/studies/tree_sampled.py --drafters eagle3,dflash --k 4,7 --limit 4 --max-tokens 96
"""

from __future__ import annotations

import argparse

from verispec import LLM, SamplingParams
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters.shipped import resolve

LEARNED = ("eagle3", "dflash", "dspark")


def run_arm(model: str, dtype: str, method: str, k: int, tree: bool, prompts: dict[str, list[list[int]]],
            temperature: float, max_tokens: int, draft: str | None) -> dict[str, tuple[float, float]]:
    """workload -> (tau, verified positions per step) of one arm."""
    spec = {"method": method, "num_speculative_tokens": k, "draft_tree": tree, "adaptive": False}
    if draft is not None:
        spec["model"] = draft
    llm = LLM(model, dtype=dtype, device="cpu", progress=False, speculative_config=spec, scheduler="static",
              max_num_seqs=max(map(len, prompts.values())))
    out = {}
    for w, items in prompts.items():
        params = [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i) for i in range(len(items))]
        res = llm.generate([{"prompt_token_ids": ids} for ids in items], params, use_tqdm=False)
        steps = sum(o.stats["steps"] for o in res)
        accepted = sum(o.stats["num_accepted_tokens"] for o in res)
        drafted = sum(o.stats["num_draft_tokens"] for o in res)
        out[w] = (1 + accepted / steps if steps else float("nan"), 1 + drafted / steps if steps else float("nan"))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="SmolLM2-135M-Instruct")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--limit", type=int, default=4, help="prompts per workload")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--k", default="4,7", help="draft positions per step (chain length = tree node budget)")
    ap.add_argument("--drafters", default="eagle3,dflash", help="any of ngram, suffix, eagle3, dflash, dspark, "
                    "draft_model (with --draft-model)")
    ap.add_argument("--draft-model", default=None, help="the draft model of draft_model (same tokenizer)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    for m in LEARNED:
        ap.add_argument(f"--{m}", default=f"smollm2-135m-instruct-{m}", help=f"the {m} drafter (shipped name or dir)")
    args = ap.parse_args(argv)
    tok = LLM(args.model, dtype=args.dtype, device="cpu", progress=False)
    prompts = {w: [tok.tokenizer(tok.apply_chat_template(list(p.messages)), add_special_tokens=False)["input_ids"]
                   for p in load_workload(w)[: args.limit]] for w in args.workloads.split(",")}
    del tok
    print(f"\n## Trees vs chains at T = {args.temperature}: {args.model} ({args.dtype}), {args.limit} prompts per "
          f"workload, {args.max_tokens} max tokens, seeds 0..{args.limit - 1}\n")
    print("| drafter | workload | k | chain tau | tree tau | tree / chain | verified per step (chain / tree) |")
    print("|---|---|---|---|---|---|---|")
    for name in args.drafters.split(","):
        draft = str(resolve(getattr(args, name))) if name in LEARNED else args.draft_model
        for k in (int(x) for x in args.k.split(",")):
            chain, tree = (run_arm(args.model, args.dtype, name, k, t, prompts, args.temperature, args.max_tokens,
                                   draft) for t in (False, True))
            for w in prompts:
                print(f"| {name} | {w} | {k} | {chain[w][0]:.2f} | {tree[w][0]:.2f} | x{tree[w][0] / chain[w][0]:.2f} "
                      f"| {chain[w][1]:.1f} / {tree[w][1]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
