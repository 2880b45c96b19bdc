"""Structured outputs on the default model at concurrency 1: validity, identity and speed.

For each (JSON schema, prompt) pair of benchmarks/structured_cases.py, in one interleaved run:
  constrained    - plain greedy decoding under the schema (response_format json_schema), first (its length sets
                   the plain arm's);
  plain          - unconstrained plain greedy decoding of exactly as many tokens (ignore_eos, max_tokens = the
                   constrained answer's length), so that the two arms decode the same number of tokens after the
                   same prompt and their ratio is the mask's cost, not a difference in answer lengths;
  spec:<method>  - constrained under speculation, one arm per drafter of --methods (default n-gram and suffix),
                   drafting through the grammar (its forced tokens, the drafter's chain, the tokens forced after
                   it), the default scheduler; plain and the spec arms run after constrained, in an order that
                   reverses from pair to pair;
then sampled (temperature 0.8, seed = pair index) constrained plain and speculative runs for validity.
Checks: every constrained answer parses and validates with `jsonschema` (greedy and sampled, with and without
speculation); greedy spec == greedy constrained token for token. Speed: output tokens per second of each arm summed
over the pairs, two ways: end to end (sum of tokens / sum of request seconds, prefill and the schema's compilation
included) and decode (tokens after the first / seconds after the first: 1 / TPOT). Each engine answers one constrained request
before the run: building llguidance's view of the tokenizer (about 1.5 s, once per process) is start-up, reported
apart. Run niced: `nice -n 10 python benchmarks/structured.py [--limit N] [--json out.json]`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_cases import CASES  # noqa: E402


def valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=int, default=len(CASES))
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--methods", default="ngram,suffix",
                    help="the speculative arms' drafters, beside the grammar's forced tokens, each its own arm (suffix: "
                         "with its cache of earlier outputs, which that arm's own earlier requests fill, as a "
                         "server's would)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from verispec import LLM, SamplingParams

    llm = LLM(progress=False)
    methods = args.methods.split(",")
    specs = {m: llm.with_speculation({"method": m, "num_speculative_tokens": args.k}) for m in methods}
    cases = CASES[: args.limit]
    arms = {"plain": (llm, False), "constrained": (llm, True), **{f"spec:{m}": (e, True) for m, e in specs.items()}}
    tokens = {a: 0 for a in arms}
    seconds = {a: 0.0 for a in arms}
    decode_tokens = {a: 0 for a in arms}
    decode_seconds = {a: 0.0 for a in arms}
    records = []
    hi = [{"role": "user", "content": "Hi"}]
    llm.chat(hi, SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    t = time.perf_counter()
    llm.chat(hi, SamplingParams(max_tokens=4, temperature=0, structured_outputs={"json_object": True}), use_tqdm=False)
    startup = time.perf_counter() - t
    for e in specs.values():
        e.chat(hi, SamplingParams(max_tokens=4, temperature=0, structured_outputs={"json_object": True}),
               use_tqdm=False)
    checked = ["constrained", *(f"spec:{m}" for m in methods), "sampled_constrained",
               *(f"sampled_spec:{m}" for m in methods)]
    for i, case in enumerate(cases):
        msgs = [{"role": "user", "content": case["prompt"]}]
        fmt = {"json": case["schema"]}
        rec = {"id": case["id"]}
        rest = [a for a in arms if a != "constrained"]
        order = ["constrained"] + (rest if i % 2 == 0 else rest[::-1])
        for name in order:
            model, constrained = arms[name]
            n = len(rec["constrained"]["tokens"]) if name == "plain" else args.max_tokens
            p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=name == "plain",
                               structured_outputs=fmt if constrained else None)
            t = time.perf_counter()
            out = model.chat(msgs, p, use_tqdm=False)[0]
            seconds[name] += time.perf_counter() - t
            tokens[name] += len(out.token_ids)
            decode_tokens[name] += out.stats["output_tokens"] - 1
            decode_seconds[name] += out.stats["e2e_s"] - out.stats["ttft_s"]
            rec[name] = {"tokens": out.token_ids, "text": out.text, "finish": out.finish_reason,
                         "tau": out.stats["mean_acceptance_length"], "drafted": out.stats["num_draft_tokens"]}
        for name, model in (("sampled_constrained", llm), *((f"sampled_spec:{m}", e) for m, e in specs.items())):
            p = SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=fmt)
            out = model.chat(msgs, p, use_tqdm=False)[0]
            rec[name] = {"text": out.text, "finish": out.finish_reason}
        for name in checked:
            rec[name]["valid"] = valid(rec[name]["text"], case["schema"])
        rec["identical"] = {m: rec[f"spec:{m}"]["tokens"] == rec["constrained"]["tokens"] for m in methods}
        records.append(rec)
        taus = " ".join(f"{m} {rec[f'spec:{m}']['tau']:.2f}" for m in methods)
        print(f"{case['id']:22s} valid {[rec[n]['valid'] for n in checked]} identical "
              f"{list(rec['identical'].values())} tau {taus} tokens {len(rec['constrained']['tokens'])}", flush=True)
    rate = {a: tokens[a] / seconds[a] for a in arms}
    decode = {a: decode_tokens[a] / decode_seconds[a] for a in arms}
    summary = {
        "pairs": len(records),
        "valid": {n: sum(r[n]["valid"] for r in records) for n in checked},
        "identical": {m: sum(r["identical"][m] for r in records) for m in methods},
        "tokens": tokens,
        "tok_per_s": {a: round(v, 2) for a, v in rate.items()},
        "decode_tok_per_s": {a: round(v, 2) for a, v in decode.items()},
        "spec_over_constrained": {m: round(rate[f"spec:{m}"] / rate["constrained"], 3) for m in methods},
        "decode_spec_over_constrained": {m: round(decode[f"spec:{m}"] / decode["constrained"], 3) for m in methods},
        "constrained_over_plain": round(rate["constrained"] / rate["plain"], 3),
        "decode_constrained_over_plain": round(decode["constrained"] / decode["plain"], 3),
        "grammar_startup_s": round(startup, 3),
        "mean_tau": {m: round(sum(r[f"spec:{m}"]["tau"] for r in records) / len(records), 3) for m in methods},
        "k": args.k, "max_tokens": args.max_tokens, "dtype": llm.dtype, "quantization": llm.quantization,
        "scheduler": next(iter(specs.values())).scheduler_name,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
