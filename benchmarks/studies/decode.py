"""Plain single-stream decoding speed: verispec vs HF transformers `generate`, same weights, dtype and prompts.

Conditions (MEASURE.md): concurrency 1; metric = output tok/s of one stream (greedy, fixed output length, prefill
included, and the decode-only rate); baseline = HF transformers generate on the same dequantised weights, same dtype.
Runs are interleaved (ours, HF, HF, ours, ...) and repeated; ratios are medians over repeats from this one run.

It also times the pure matmul floor: the model's own linear layers alone (one token, same dtype), and reports our
per-token decode time divided by that floor.

    python benchmarks/studies/decode.py --dtypes float32,bfloat16 --repeats 3 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from verispec import LLM, SamplingParams

PROMPTS = [
    "Write a JSON array with five users, each with id, name, email and role.",
    "Explain in a few sentences how a hash map works.",
    "Write a Python function that checks whether a string is a palindrome.",
]


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_floor_s(llm: LLM, repeats: int = 30) -> float:
    """Seconds for the model's linear layers alone on one token (qkv, o, gate_up, down per layer, lm_head)."""
    m = llm.model
    weights = [w for layer in m.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    weights.append(m.output_weight())
    xs = {w.shape[1]: torch.randn(1, w.shape[1], dtype=m.dtype) for w in weights}
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            for w in weights:
                F.linear(xs[w.shape[1]], w)
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def run_ours(llm: LLM, ids: list[int], n: int) -> tuple[float, float]:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       use_tqdm=False)[0]
    s = out.stats
    assert s["output_tokens"] == n
    return s["e2e_s"], s["e2e_s"] - s["ttft_s"]


def run_hf(hf, ids: list[int], n: int) -> tuple[float, float]:
    x = torch.tensor([ids])
    first = {}

    class FirstToken:  # a streamer that notes when the first new token arrives
        def put(self, value):
            if "t" not in first and value.shape[-1] == 1 and "prompt_seen" in first:
                first["t"] = time.perf_counter()
            first["prompt_seen"] = True

        def end(self):
            pass

    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(x, do_sample=False, max_new_tokens=n, min_new_tokens=n, streamer=FirstToken(), pad_token_id=2)
    t1 = time.perf_counter()
    assert out.shape[1] - len(ids) == n
    return t1 - t0, t1 - first.get("t", t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="write the raw results here")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {torch.backends.cpu.get_cpu_capability()}")
    results = {}
    for dtype in args.dtypes.split(","):
        rss0 = rss_mib()
        llm = LLM(args.model, dtype=dtype, device="cpu", max_model_len=1024, progress=False)
        rss_ours = rss_mib() - rss0
        hf = AutoModelForCausalLM.from_pretrained(str(llm.resolved.directory), dtype=getattr(torch, dtype)).eval()
        rss_hf = rss_mib() - rss0 - rss_ours
        prompts = [llm.tokenizer(llm.apply_chat_template([{"role": "user", "content": p}]),
                                 add_special_tokens=False)["input_ids"] for p in PROMPTS]
        run_ours(llm, prompts[0], 4), run_hf(hf, prompts[0], 4)  # warm-up
        ratios, dec_ratios, ours_tps, hf_tps, ours_tok_s = [], [], [], [], []
        for r in range(args.repeats):
            for i, ids in enumerate(prompts):
                order = [("ours", run_ours, llm), ("hf", run_hf, hf)]
                if (r + i) % 2:
                    order.reverse()
                got = {name: fn(obj, ids, args.max_tokens) for name, fn, obj in order}
                n = args.max_tokens
                ratios.append(got["hf"][0] / got["ours"][0])
                dec_ratios.append(got["hf"][1] / got["ours"][1])
                ours_tps.append(n / got["ours"][0])
                hf_tps.append(n / got["hf"][0])
                ours_tok_s.append(got["ours"][1] / (n - 1))
        floor = matmul_floor_s(llm)
        per_tok = statistics.median(ours_tok_s)
        res = {
            "dtype": dtype,
            "ours_tok_s": statistics.median(ours_tps),
            "hf_tok_s": statistics.median(hf_tps),
            "speedup_median": statistics.median(ratios),
            "speedup_min": min(ratios),
            "speedup_max": max(ratios),
            "decode_speedup_median": statistics.median(dec_ratios),
            "ours_ms_per_token": per_tok * 1000,
            "matmul_floor_ms": floor * 1000,
            "per_token_over_floor": per_tok / floor,
            "ours_model_rss_mib": rss_ours,
            "hf_model_rss_mib": rss_hf,
            "weights_mib": sum(p.numel() * p.element_size() for p in llm.model.parameters()) / 2**20,
            "kv_cache_mib": sum(t.numel() * t.element_size() for t in llm.cache.k + llm.cache.v) / 2**20,
            "peak_rss_mib": rss_mib(),
            "samples": len(ratios),
        }
        results[dtype] = res
        print(
            f"{dtype:9s} verispec {res['ours_tok_s']:6.1f} tok/s | HF {res['hf_tok_s']:6.1f} tok/s | "
            f"speedup x{res['speedup_median']:.2f} (min {res['speedup_min']:.2f}, max {res['speedup_max']:.2f}; "
            f"decode-only x{res['decode_speedup_median']:.2f}) | {res['ours_ms_per_token']:.1f} ms/token, "
            f"floor {res['matmul_floor_ms']:.1f} ms, ratio {res['per_token_over_floor']:.2f} | "
            f"weights {res['weights_mib']:.0f} MiB, KV {res['kv_cache_mib']:.0f} MiB, peak RSS {res['peak_rss_mib']:.0f} MiB",
            flush=True,
        )
        del llm, hf
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
