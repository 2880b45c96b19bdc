"""What the seeded rule (sampling/coupled.py) costs in acceptance: sampling drafters at T > 0 under three conditions.

Conditions:
  - Model: the default model (--dtype as given), CPU; the shipped drafters of --drafters (sampling: EAGLE-3, DFlash,
    DSpark); prompts: the first --limit prompts of each --workloads, chat template applied; --max-tokens each;
    temperature --temperature; K = --k fixed (adaptive off, the static scheduler), one request at a time.
  - Metric: acceptance = accepted draft tokens / drafted tokens; tau = committed tokens per speculative step.
  - Baseline: `leviathan`, unseeded requests (Leviathan / Chen: a draft drawn from q accepted with min(1, p/q), the
    rule before the race and still the one for unseeded requests). Against it: `race+coupled`, seeded requests (the
    race; the drafter draws with the target's position noise, the default), and `race+independent`, seeded requests
    whose drafter draws from its own stream (coupled.COUPLE_DRAFTS off). Seeds 0.. per prompt, the same in every
    condition; the three conditions interleaved per prompt, --repeats rounds with different seeds.

    python benchmarks/seeded_acceptance.py --drafters eagle3,dflash,dspark --limit 4 --max-tokens 64
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import verispec.sampling.coupled as coupled
from verispec import LLM, SamplingParams
from verispec.bench.workloads import load_workload

CONDITIONS = ("leviathan", "race+coupled", "race+independent")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafters", default="eagle3,dflash,dspark")
    ap.add_argument("--workloads", default="chat,code")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.9)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    for method in args.drafters.split(","):
        llm = LLM(dtype=args.dtype, progress=False, max_num_seqs=1, scheduler="static",
                  speculative_config={"method": method, "num_speculative_tokens": args.k, "adaptive": False})
        prompts = [wp for w in args.workloads.split(",") for wp in load_workload(w, args.limit)]
        ids = [llm.tokenizer(llm.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
               for wp in prompts]
        tot: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # drafted, accepted, steps
        for r in range(args.repeats):
            for i, prompt in enumerate(ids):
                for cond in CONDITIONS:
                    coupled.COUPLE_DRAFTS = cond != "race+independent"
                    seed = None if cond == "leviathan" else 1000 * r + i
                    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=seed,
                                            ignore_eos=True)
                    st = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].stats
                    t = tot[cond]
                    t[0], t[1] = t[0] + st["num_draft_tokens"], t[1] + st["num_accepted_tokens"]
                    t[2] += st["steps"]
        coupled.COUPLE_DRAFTS = True
        for cond in CONDITIONS:
            d, a, s = tot[cond]
            print(f"{method:8s} {cond:17s} drafted {d:6d} accepted {a:6d} acceptance {a / max(d, 1):.3f} "
                  f"tau {1 + a / max(s, 1):.2f}", flush=True)


if __name__ == "__main__":
    main()
