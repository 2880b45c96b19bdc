"""Structured outputs on the default model at concurrency 1: validity, identity and speed.

For each (JSON schema, prompt) pair of benchmarks/structured_cases.py, in one interleaved run:
  constrained    - plain greedy decoding under the schema (response_format json_schema), first (its length sets
                   the plain arm's);
  plain          - unconstrained plain greedy decoding of exactly as many tokens (ignore_eos, max_tokens = the
                   constrained answer's length), so that the two arms decode the same number of tokens after the
                   same prompt and their ratio is the mask's cost, not a difference in answer lengths;
  spec           - constrained under speculation: n-gram drafts plus the grammar's forced tokens, the default
                   scheduler (plain and spec alternate their order from pair to pair);
then sampled (temperature 0.8, seed = pair index) constrained plain and speculative runs for validity.
Checks: every constrained answer parses and validates with `jsonschema` (greedy and sampled, with and without
speculation); greedy spec == greedy constrained token for token. Speed: output tokens per second of each arm summed
over the pairs, two ways: end to end (sum of tokens / sum of request seconds, prefill and the schema's compilation
included) and decode (tokens after the first / seconds after the first). Each engine answers one constrained request
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
    ap.add_argument("--method", default="ngram", choices=["ngram", "suffix"],
                    help="the speculative arm's drafter, beside the grammar's forced tokens (suffix: with its cache of "
                         "earlier outputs, which the arm's own earlier requests fill, as a server's would)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    from verispec import LLM, SamplingParams

    llm = LLM(progress=False)
    spec = llm.with_speculation({"method": args.method, "num_speculative_tokens": args.k})
    cases = CASES[: args.limit]
    arms = {"plain": (llm, False), "constrained": (llm, True), "spec": (spec, True)}
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
    spec.chat(hi, SamplingParams(max_tokens=4, temperature=0, structured_outputs={"json_object": True}), use_tqdm=False)
    for i, case in enumerate(cases):
        msgs = [{"role": "user", "content": case["prompt"]}]
        fmt = {"json": case["schema"]}
        rec = {"id": case["id"]}
        order = ["constrained"] + (["plain", "spec"] if i % 2 == 0 else ["spec", "plain"])
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
        for name, model in (("sampled_constrained", llm), ("sampled_spec", spec)):
            p = SamplingParams(temperature=0.8, seed=i, max_tokens=args.max_tokens, structured_outputs=fmt)
            out = model.chat(msgs, p, use_tqdm=False)[0]
            rec[name] = {"text": out.text, "finish": out.finish_reason}
        for name in ("constrained", "spec", "sampled_constrained", "sampled_spec"):
            rec[name]["valid"] = valid(rec[name]["text"], case["schema"])
        rec["identical"] = rec["spec"]["tokens"] == rec["constrained"]["tokens"]
        records.append(rec)
        print(f"{case['id']:22s} valid {[rec[n]['valid'] for n in ('constrained', 'spec', 'sampled_constrained', 'sampled_spec')]} "
              f"identical {rec['identical']} tau {rec['spec']['tau']:.2f} tokens {len(rec['spec']['tokens'])}",
              flush=True)
    rate = {a: tokens[a] / seconds[a] for a in arms}
    decode = {a: decode_tokens[a] / decode_seconds[a] for a in arms}
    summary = {
        "pairs": len(records),
        "valid": {n: sum(r[n]["valid"] for r in records) for n in ("constrained", "spec", "sampled_constrained",
                                                                     "sampled_spec")},
        "identical": sum(r["identical"] for r in records),
        "tokens": tokens,
        "tok_per_s": {a: round(v, 2) for a, v in rate.items()},
        "decode_tok_per_s": {a: round(v, 2) for a, v in decode.items()},
        "spec_over_constrained": round(rate["spec"] / rate["constrained"], 3),
        "constrained_over_plain": round(rate["constrained"] / rate["plain"], 3),
        "decode_spec_over_constrained": round(decode["spec"] / decode["constrained"], 3),
        "decode_constrained_over_plain": round(decode["constrained"] / decode["plain"], 3),
        "grammar_startup_s": round(startup, 3),
        "mean_tau_spec": round(sum(r["spec"]["tau"] for r in records) / len(records), 3),
        "method": args.method, "k": args.k, "max_tokens": args.max_tokens, "dtype": llm.dtype, "quantization": llm.quantization,
        "scheduler": spec.scheduler_name,
    }
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "records": records}, indent=1))


if __name__ == "__main__":
    main()
