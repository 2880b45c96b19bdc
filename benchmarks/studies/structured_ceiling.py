"""How fast could speculation with the grammar's forced tokens make schema-constrained decoding, drafter by drafter?

Issue 63 asks speculation with n-gram plus the grammar's forced tokens to reach x2 of plain constrained decoding
per token (the structured workload, benchmarks/structured_cases.py). This study bounds it from the default model's
own greedy constrained answers: each step drafts as the engine does (engine/constrain.py: the tokens the grammar
forces, then the drafter's chain continuing them, then the tokens forced after it, up to k) with, as the chain,
nothing, the shipped n-gram drafter's proposal, or the copy ceiling (the longest run of the answer found earlier
in prompt + answer: verispec/bench/ceiling.py); a scheduler that knew each step's run verifies exactly it (a step's
forward at run + 1 tokens, from this machine's profile), drafting and the grammar's masks free.

Conditions (MEASURE.md):
  - Model: the default model and weight path (dtype auto), CPU, concurrency 1, in process; the first --limit
    (schema, prompt) pairs of the structured workload, greedy constrained, --max-tokens.
  - Metric: tau (tokens per step) and the decode speedup (per token after the first) of each drafting.
  - Baseline: plain constrained decoding of the same answers, one token per step at the one-row forward's cost.

    python benchmarks/studies/structured_ceiling.py --limit 60 --k 8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

from verispec import LLM, SamplingParams
from verispec.bench.ceiling import copy_run, decode_ceiling, drafter_run, matched
from verispec.drafters.ngram import NgramDrafter
from verispec.engine.costs import StepCosts
from verispec.engine.profile import profile_costs
from verispec.sampling.grammar import StructuredOutputsParams

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from structured_cases import CASES  # noqa: E402

Chain = Callable[[list[int], int, int], int]  # (prompt + answer, position, room) -> run of the chain there


def steps(matcher, seq: list[int], start: int, k: int, chain: Chain) -> list[int]:
    """Each step's accepted run over seq[start:] (the answer after its first token, which the matcher has
    committed): forced tokens, the chain, forced tokens after it, and so on up to k, as long as each matches."""
    runs, i = [], start
    while i < len(seq):
        room, run = min(k, len(seq) - i - 1), 0
        while run < room:
            forced = matcher.forced_after(seq[i : i + run], room - run) if run else matcher.forced(room - run)
            n = matched(forced, seq, i + run)
            if n == 0:
                n = chain(seq, i + run, room - run)
                if n == 0:
                    break
            run += n
            if n < len(forced):
                break  # a forced token the answer does not take (another tokenization): the draft ends there
        runs.append(run)
        matcher.commit(seq[i : i + run + 1])
        i += run + 1
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=len(CASES))
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--profile-repeats", type=int, default=25, help="forwards per block size, the median kept")
    args = ap.parse_args()
    llm = LLM(progress=False)
    costs = StepCosts(profile_costs(llm.model, tuple(range(1, args.k + 2)), repeats=args.profile_repeats))
    print("step costs (ms after 128 tokens): " + ", ".join(f"M={m} {1e3 * costs(m):.2f}" for m in range(1, args.k + 2)))
    chains: dict[str, Callable[[], Chain]] = {  # a chain per answer (n-gram keeps an index of its context)
        "forced tokens only": lambda: (lambda seq, i, room: 0),
        "forced + n-gram": lambda: drafter_run(NgramDrafter()),
        "forced + copy ceiling": lambda: copy_run,
    }
    runs: dict[str, list[int]] = {name: [] for name in chains}
    for case in CASES[: args.limit]:
        spec = {"json": case["schema"]}
        out = llm.chat([{"role": "user", "content": case["prompt"]}],
                       SamplingParams(temperature=0, max_tokens=args.max_tokens, structured_outputs=spec),
                       use_tqdm=False)[0]
        prompt, answer = list(out.prompt_token_ids), list(out.outputs[0].token_ids)
        for name, make in chains.items():
            matcher = llm.processors.compiler.matcher(StructuredOutputsParams.from_any(spec))
            matcher.commit(answer[:1])
            runs[name] += steps(matcher, prompt + answer, len(prompt) + 1, args.k, make())
    print(f"\n{args.limit} pairs, k = {args.k}, greedy; a scheduler that knew each step's run, drafting and masks "
          f"free\n\n| drafting | tau | decode speedup over plain constrained |\n|---|---|---|")
    for name, r in runs.items():
        print(f"| {name} | {sum(x + 1 for x in r) / len(r):.2f} | x{decode_ceiling(r, costs):.2f} |")
    print("\nruns of forced + n-gram (accepted drafts per step: steps): "
          + ", ".join(f"{n}: {runs['forced + n-gram'].count(n)}" for n in range(args.k + 1)))


if __name__ == "__main__":
    main()
