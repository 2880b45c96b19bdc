"""`verispec demo`: the main job on the default model, a short single-stream comparison that a person can read.

One prompt from each shipped workload, greedy; plain decoding, then each model-free drafter on the same prompt.
Figures: output tok/s of one stream (prefill included), speedup = drafter tok/s / plain tok/s on the same prompt
in the same run, tau = tokens per target forward, and whether the output is token-identical to plain.
"""

from __future__ import annotations

import argparse
import sys

from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.check.identity import compare_greedy

DRAFTERS = {"ngram": {"method": "ngram", "num_speculative_tokens": 8},
            "suffix": {"method": "suffix", "num_speculative_tokens": 8}}


def run_demo(args: argparse.Namespace) -> int:
    from verispec import LLM, SamplingParams

    print(f"verispec demo: loading {args.model} ({args.dtype}) ...", file=sys.stderr, flush=True)
    base = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len or 2048)
    engines = {"none": base}
    for name, spec in DRAFTERS.items():
        try:
            engines[name] = base.with_speculation(spec)
        except ImportError:  # a drafter this build does not have
            continue
    for e in engines.values():
        if e.spec.method != "none":
            e.costs  # noqa: B018  profile the step costs once, before anything is timed
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    rows = []
    for wl in WORKLOADS:
        prompt = load_workload(wl, limit=1)[0]
        text = base.apply_chat_template(list(prompt.messages))
        ids = base.tokenizer(text, add_special_tokens=False)["input_ids"]
        print(f"\n### {wl}: {prompt.messages[-1]['content'][:100]}", flush=True)
        outs = {}
        for name, engine in engines.items():
            outs[name] = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
            print(f"[{name}] {outs[name].stats['tok_per_s']:.1f} tok/s", file=sys.stderr, flush=True)
        print(outs["none"].text.strip()[:400], flush=True)
        plain = outs["none"]
        for name, out in outs.items():
            div = None if name == "none" else compare_greedy(base.model, ids, plain.token_ids, out.token_ids)
            rows.append((wl, name, out.stats["output_tokens"], out.stats["tok_per_s"],
                         out.stats["tok_per_s"] / plain.stats["tok_per_s"], out.stats["mean_acceptance_length"],
                         "yes" if div is None else ("near-tie" if div.near_tie else "NO")))
    print(f"\nSingle stream, concurrency 1, greedy, {args.dtype}, baseline = plain decoding (method none), "
          "same prompt, same run.")
    print("| workload | method | tokens | tok/s | speedup | tau | identical |")
    print("|---|---|---|---|---|---|---|")
    for wl, name, n, tps, ratio, tau, same in rows:
        print(f"| {wl} | {name} | {n} | {tps:.1f} | x{ratio:.2f} | {tau:.2f} | {same} |")
    return 0
