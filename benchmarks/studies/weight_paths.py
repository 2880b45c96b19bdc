"""Plain and speculative decoding per weight path of the default model: dense fp32, dense bf16, the GGUF's own
int4 blocks (`quantization="gguf"`, bf16 activations, batch-invariant attention) and the GGUF's own blocks on
verispec's kernel (`quantization="gguf-q8act"`, int8 activations per 32 values, fp32 elsewhere).

Conditions (MEASURE.md): concurrency 1; metric = output tok/s of one stream (whole request, prefill included)
and decode ms/token (after the first token); baselines = plain decoding on the same path AND the fastest plain
path of the run (speculation is judged against the fastest plain configuration, not a slow one). Every
(path, method) engine runs every prompt, interleaved (the order rotates per prompt and repeat); ratios are
taken on the same prompt and repeat, median (min..max). Greedy identity: speculative tokens == plain tokens of
the same path, bitwise.

    python benchmarks/studies/weight_paths.py --limit 1 --max-tokens 64 --repeats 2 [--dspark] --json paths.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict

import torch

from verispec import LLM, SamplingParams
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.kernels.cpu import cpu_info

PATHS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
         "gguf-int4": dict(dtype="bfloat16", quantization="gguf"),
         "gguf-q8act": dict(dtype="float32", quantization="gguf-q8act")}


def engines(args) -> dict[tuple[str, str], LLM]:
    out = {}
    for path in args.paths.split(","):
        base = LLM(args.model, device="cpu", max_model_len=2048, max_num_seqs=1, progress=False, **PATHS[path])
        out[(path, "none")] = base
        out[(path, "ngram")] = base.with_speculation(
            {"method": "ngram", "num_speculative_tokens": args.k, "adaptive": False})
        if args.dspark:  # ngram under the DSpark scheduler: verify where drafts survive, off where they do not
            scheduled = base.with_speculation({"method": "ngram", "num_speculative_tokens": 8})
            scheduled.configure_engine(scheduler="dspark")
            out[(path, "ngram-dspark")] = scheduled
    return out


def run(args) -> list[dict]:
    eng = engines(args)
    base = next(iter(eng.values()))
    prompts = [wp for wl in args.workloads.split(",") for wp in load_workload(wl, limit=args.limit)]
    records = []
    for r in range(args.repeats):
        for i, wp in enumerate(prompts):
            ids = base.tokenizer(base.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
            params = SamplingParams(temperature=0, max_tokens=min(wp.max_tokens, args.max_tokens))
            keys = list(eng)
            shift = (r * len(prompts) + i) % len(keys)
            for key in keys[shift:] + keys[:shift]:
                out = eng[key].generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
                s = out.stats
                records.append({"path": key[0], "method": key[1], "prompt": wp.id, "repeat": r,
                                "tok_per_s": s["tok_per_s"], "decode_tok_per_s": s["decode_tok_per_s"],
                                "tau": s["mean_acceptance_length"], "tokens": out.token_ids})
            print(f"repeat {r} prompt {wp.id} done", file=sys.stderr, flush=True)
    return records


def summarise(records: list[dict]) -> list[dict]:
    by = {(x["path"], x["method"], x["prompt"], x["repeat"]): x for x in records}
    plain_best = defaultdict(float)  # (prompt, repeat) -> the fastest plain tok/s of that prompt and repeat
    for x in records:
        if x["method"] == "none":
            plain_best[(x["prompt"], x["repeat"])] = max(plain_best[(x["prompt"], x["repeat"])], x["tok_per_s"])
    rows = []
    for path, method in dict.fromkeys((x["path"], x["method"]) for x in records):
        xs = [x for x in records if x["path"] == path and x["method"] == method]
        own = [x["tok_per_s"] / by[(path, "none", x["prompt"], x["repeat"])]["tok_per_s"] for x in xs]
        best = [x["tok_per_s"] / plain_best[(x["prompt"], x["repeat"])] for x in xs]
        same = [x["tokens"] == by[(path, "none", x["prompt"], x["repeat"])]["tokens"] for x in xs]
        dec = statistics.median(x["decode_tok_per_s"] for x in xs)
        rows.append({"path": path, "method": method, "tok_per_s": statistics.median(x["tok_per_s"] for x in xs),
                     "decode_ms_per_token": 1000 / dec if dec else float("nan"),
                     "vs_own_plain": _spread(own), "vs_fastest_plain": _spread(best),
                     "tau": statistics.median(x["tau"] for x in xs), "identical": f"{sum(same)}/{len(same)}"})
    return rows


def _spread(v: list[float]) -> str:
    return f"x{statistics.median(v):.2f} ({min(v):.2f}..{max(v):.2f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--paths", default=",".join(PATHS))
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--limit", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("-k", type=int, default=6, help="ngram draft tokens per step (static)")
    p.add_argument("--dspark", action="store_true", help="also ngram (k = 8) under the dspark scheduler")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    cpu = cpu_info().as_dict()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU {cpu_info().label()}", file=sys.stderr)
    records = run(args)
    rows = summarise(records)
    cols = ["path", "method", "tok_per_s", "decode_ms_per_token", "vs_own_plain", "vs_fastest_plain", "tau",
            "identical"]
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for row in rows:
        print("| " + " | ".join(f"{row[c]:.1f}" if isinstance(row[c], float) else str(row[c]) for c in cols) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu, "torch": torch.__version__, "rows": rows, "records": records}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
