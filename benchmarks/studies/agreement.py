"""Numerical agreement of each weight path of the default model with a dense fp32 reference.

Conditions:
  - Model: smollm2-135m-instruct (the cached GGUF, SmolLM2-135M-Instruct Q4_1), CPU.
  - Reference: `fp32` = dense float32 weights dequantised from that GGUF. Paths compared with it: `bf16` (the same
    dense weights cast to bfloat16), `gguf-int4` (`quantization="gguf"`: the GGUF's own Q4_1 blocks on aten's
    int4 kernel, bfloat16 activations) and `gguf-q8act` (the GGUF's own blocks and Q8_0 head on verispec's kernel,
    activations rounded to int8 per 32 values as llama.cpp does), and `gguf-q8act-fp16kv` (that path with
    `kv_cache_dtype="float16"`: K/V rounded to float16 as written, as llama.cpp's default cache is). The `fp32` row is the reference compared with itself (a sanity row).
  - Prompts: the first --limit prompts (default 2) of each shipped workload (default all), chat template applied.
  - Teacher forcing: the reference decodes a greedy continuation of T = --tokens (default 64) tokens
    (ignore_eos, so every continuation has exactly T tokens); then every path runs prompt + continuation in ONE
    forward (`prefill_fresh`) and its logits at the T positions that predict the continuation are compared row by
    row with the reference's: top-1 = fraction of positions whose argmax equals the reference's argmax; max / p99 /
    median of |logit - reference logit| over all positions x vocabulary entries.
  - Greedy divergence: every path also decodes its own free-running greedy continuation of T tokens (verispec
    `LLM.generate`, temperature 0, ignore_eos); first_div = index of its first token that differs from the
    reference continuation (T when none does), reported as median (min..max); identical = prompts whose T tokens
    all match. `tf_vs_gen` (footer) = positions where the reference's teacher-forced argmax equals the token its
    own engine decode chose (the one-forward vs step-by-step check of the reference itself).
  - llama.cpp (optional, `--llama-logits TOOL`): benchmarks/studies/llama_cpp_logits.cpp built against your own llama.cpp
    build (see its header; llama.cpp is not a dependency) evaluates the same prompt + continuation on the same GGUF
    in one batch (its default context: f16 KV cache) and returns the logits at the same positions. It is compared
    with the reference like a path (a `llama.cpp` row: teacher-forced only, it does not decode), and every path is
    also compared with it (a second table: top-1 agreement and |logit diff| against llama.cpp's logits).

    python benchmarks/studies/agreement.py --limit 2 --tokens 64 [--llama-logits ./llama_cpp_logits] --json agreement.json
    python benchmarks/studies/agreement.py --paths fp32,gguf-q8act,gguf-q8act-fp16kv
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

import numpy as np
import torch

from verispec import LLM, SamplingParams
from verispec.bench.workloads import WORKLOADS, load_workload

PATHS = {"fp32": dict(dtype="float32"), "bf16": dict(dtype="bfloat16"),
         "gguf-int4": dict(dtype="bfloat16", quantization="gguf"),
         "gguf-q8act": dict(dtype="float32", quantization="gguf-q8act"),
         "gguf-q8act-fp16kv": dict(dtype="float32", quantization="gguf-q8act", kv_cache_dtype="float16")}
REFERENCE = "fp32"


def build(model: str, paths: list[str]) -> dict[str, LLM]:
    """One LLM per path; the reference first."""
    order = [REFERENCE] + [p for p in paths if p != REFERENCE]
    return {p: LLM(model, device="cpu", max_model_len=2048, max_num_seqs=1, progress=False, **PATHS[p])
            for p in order}


def prompt_ids(llm: LLM, wp) -> list[int]:
    text = llm.apply_chat_template(list(wp.messages))
    return list(llm.tokenizer(text, add_special_tokens=False)["input_ids"])


def greedy(llm: LLM, ids: list[int], tokens: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return list(llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].token_ids)


def teacher_logits(llm: LLM, ids: list[int], n_prompt: int) -> torch.Tensor:
    """float32 [T, vocab]: the logits predicting ids[n_prompt:], from one forward over all of ids."""
    _, _, out = llm.model.prefill_fresh(ids, logits_indices=range(n_prompt - 1, len(ids) - 1))
    return out.logits.float()


def llama_logits(tool: str, gguf: str, ids: list[int], n_prompt: int) -> torch.Tensor:
    """float32 [T, vocab]: llama.cpp's logits predicting ids[n_prompt:] (benchmarks/studies/llama_cpp_logits.cpp)."""
    proc = subprocess.run([tool, gguf, str(torch.get_num_threads()), str(n_prompt - 1)],
                          input=" ".join(map(str, ids[:-1])).encode(), capture_output=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{tool} failed: {proc.stderr.decode(errors='replace')[-500:]}")
    return torch.from_numpy(np.frombuffer(proc.stdout, dtype=np.float32).copy()).view(len(ids) - n_prompt, -1)


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_prompt(llms: dict[str, LLM], wp, tokens: int, llama: str | None = None
               ) -> tuple[list[dict], dict[str, np.ndarray], dict]:
    """Records per path (and `llama.cpp`), |logit diff| against the reference per path (and against llama.cpp's
    logits, keyed (path, "llama.cpp")), the reference's sanity counts."""
    ref = llms[REFERENCE]
    ids = prompt_ids(ref, wp)
    cont = greedy(ref, ids, tokens)
    full = ids + cont
    ref_logits = teacher_logits(ref, full, len(ids))
    ref_top = ref_logits.argmax(-1)
    sanity = {"prompt": wp.id, "tf_vs_gen": int((ref_top == torch.tensor(cont)).sum()), "positions": len(cont)}
    ll = None if llama is None else llama_logits(llama, str(ref.resolved.gguf), full, len(ids))
    records, diffs = [], {}
    for path, llm in list(llms.items()) + ([("llama.cpp", None)] if ll is not None else []):
        logits = ref_logits if path == REFERENCE else ll if llm is None else teacher_logits(llm, full, len(ids))
        own = cont if path == REFERENCE else None if llm is None else greedy(llm, ids, tokens)
        diffs[path] = (logits - ref_logits).abs().flatten().numpy()
        rec = {"workload": wp.workload, "prompt": wp.id, "path": path, "positions": len(cont),
               "top1_match": int((logits.argmax(-1) == ref_top).sum()),
               "first_div": None if own is None else first_divergence(own, cont),
               "identical": None if own is None else own == cont, "tokens": own}
        if ll is not None:
            diffs[(path, "llama.cpp")] = (logits - ll).abs().flatten().numpy()
            rec["top1_vs_llama"] = int((logits.argmax(-1) == ll.argmax(-1)).sum())
        records.append(rec)
    return records, diffs, sanity


def run(args) -> tuple[list[dict], dict[tuple[str, str], list[np.ndarray]], list[dict]]:
    llms = build(args.model, args.paths.split(","))
    records, diffs, sanity = [], {}, []
    for wl in args.workloads.split(","):
        for wp in load_workload(wl, limit=args.limit):
            recs, d, s = run_prompt(llms, wp, args.tokens, args.llama_logits)
            records += recs
            sanity.append(s)
            for key, arr in d.items():
                diffs.setdefault((wl, key), []).append(arr)
            print(f"{wl} {wp.id} done", file=sys.stderr, flush=True)
    return records, diffs, sanity


def summarise(group: str, path: str, recs: list[dict], arrs: list[np.ndarray], top1: str = "top1_match") -> dict:
    d = np.concatenate(arrs)
    fd = [r["first_div"] for r in recs if r["first_div"] is not None]
    return {"workload": group, "path": path, "prompts": len(recs),
            "top1": sum(r[top1] for r in recs) / sum(r["positions"] for r in recs),
            "max_diff": float(d.max()), "p99_diff": float(np.percentile(d, 99)),
            "median_diff": float(np.median(d)),
            "first_div": f"{statistics.median(fd):g} ({min(fd)}..{max(fd)})" if fd else "-",
            "identical": f"{sum(bool(r['identical']) for r in recs)}/{len(recs)}" if fd else "-"}


def rows(records: list[dict], diffs: dict, against: str | None = None) -> list[dict]:
    """Per workload and overall, per path: agreement with the reference, or with `against` ("llama.cpp")."""
    workloads = list(dict.fromkeys(r["workload"] for r in records))
    paths = [p for p in dict.fromkeys(r["path"] for r in records) if p != against]
    out = []
    for wl in workloads + ["all"]:
        for path in paths:
            recs = [r for r in records if r["path"] == path and wl in ("all", r["workload"])]
            key = path if against is None else (path, against)
            arrs = [a for (w, k), xs in diffs.items() if k == key and wl in ("all", w) for a in xs]
            row = summarise(wl, path, recs, arrs, "top1_match" if against is None else "top1_vs_llama")
            out.append(row if against is None else dict(row, first_div="-", identical="-"))
    return out


def markdown(table: list[dict]) -> str:
    cols = ["workload", "path", "prompts", "top1", "max_diff", "p99_diff", "median_diff", "first_div", "identical"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in table:
        cells = [f"{row[c]:.4g}" if isinstance(row[c], float) else str(row[c]) for c in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated, of {', '.join(PATHS)}")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--limit", type=int, default=2, help="prompts per workload")
    p.add_argument("--tokens", type=int, default=64, help="T: continuation length")
    p.add_argument("--llama-logits", default=None, help="benchmarks/studies/llama_cpp_logits.cpp, built: adds llama.cpp")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    records, diffs, sanity = run(args)
    table = rows(records, diffs)
    print(f"Reference: {REFERENCE} (dense, dequantised from the GGUF); model {args.model}; T = {args.tokens}; "
          f"{args.limit} prompt(s) per workload; torch {torch.__version__}, {torch.get_num_threads()} threads.\n")
    print(markdown(table))
    if args.llama_logits:
        table_ll = rows(records, diffs, "llama.cpp")
        print("\nAgainst llama.cpp's logits on the same GGUF (same positions; first_div / identical not applicable):\n")
        print(markdown(table_ll))
        table = table + [dict(r, against="llama.cpp") for r in table_ll]
    tf = sum(s["tf_vs_gen"] for s in sanity)
    print(f"\ntf_vs_gen: {tf}/{sum(s['positions'] for s in sanity)} positions (reference teacher-forced argmax == "
          "its own decoded token).")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "torch": torch.__version__, "rows": table, "records": records,
                       "sanity": sanity}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
