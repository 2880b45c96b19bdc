"""What one decode step of `LlamaModel.forward` costs on CPU, and what each extra sequence in the step adds.

Model: the default SmolLM2-135M (30 layers, d 576, 9 heads / 3 KV heads, head_dim 64), on two paths:
  gguf    bf16 activations, int4 linears (`quantization="gguf"`), batch-invariant attention (the per-query path)
  fp32    dense fp32 weights (gguf's dequantisation), the default attention path
Conditions: torch threads = --threads (default 2); every sequence has a committed context of --context tokens
(default 200; sequence i has context + i, so rows fall in different key-length buckets); each step is one forward
of the listed block (1 sequence x 1 token, 1 x 8 tokens, 4 x 1, 16 x 1) and is rolled back, so the context stays
fixed. Logits are computed for the last row of every sequence (a real decode step) and, in the rows marked
"1 row", for the first sequence only: that isolates the decoder layers (attention included) from the lm_head,
whose bf16 / fp32 matmul cost grows with its row count. Per repeat the configurations run one after the other
(steps per configuration: 8 / sequences, at least 2), --repeats times (default 5) after one warm-up; the table
gives the median (and min) wall-clock ms per step and, for 4 and 16 sequences, the ms each sequence past the first
adds: (t(B) - t(1)) / (B - 1).

    python benchmarks/studies/forward_overhead.py [--threads 2] [--repeats 5] [--context 200] [--paths gguf fp32]
    (about 40 s on 2 cores)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.models.hub import DEFAULT_MODEL
from verispec.models.llama import LlamaModel, Segment
from verispec.models.loader import load_model
from verispec.state.kv_cache import KVCache

# (sequences, tokens per sequence, logits for every sequence's last row (else the first sequence's only))
CONFIGS = ((1, 1, True), (1, 8, True), (4, 1, True), (16, 1, True), (4, 1, False), (16, 1, False))
SLOTS = 16


def load(path: str) -> LlamaModel:
    if path == "gguf":
        return load_model(DEFAULT_MODEL, dtype="bfloat16", device="cpu", quantization="gguf", progress=False)[0]
    return load_model(DEFAULT_MODEL, dtype="float32", device="cpu", progress=False)[0]


def filled_cache(model: LlamaModel, context: int) -> KVCache:
    """SLOTS slots, slot i holding context + i committed positions (slot 0's prefill, copied)."""
    cache = model.new_cache(context + SLOTS + 16, SLOTS)
    slots = [cache.allocate() for _ in range(SLOTS)]
    invariant, model.batch_invariant = model.batch_invariant, False  # the prefill is setup, not measured
    ids = torch.arange(context + SLOTS) * 7 % model.cfg.vocab_size
    model.prefill(ids, cache, slots[0])
    model.batch_invariant = invariant
    for i, s in enumerate(slots[1:], 1):
        for t in cache.k + cache.v:
            t[s] = t[slots[0]]
        cache.reserve(s, context + i)
        cache.commit(s, context + i)
    cache.rollback(slots[0], context)
    return cache


def step(model: LlamaModel, cache: KVCache, sequences: int, n: int, all_logits: bool = True) -> None:
    """One forward of n new tokens in each of the first `sequences` slots, then rolled back."""
    segs = [Segment(s, cache.length(s), n) for s in range(sequences)]
    model(torch.arange(sequences * n) % model.cfg.vocab_size, segs, cache, logits_indices=None if all_logits else [0])
    for s in segs:
        cache.rollback(s.slot, s.start)


def measure(model: LlamaModel, cache: KVCache, repeats: int) -> dict[tuple[int, int, bool], list[float]]:
    """Configuration -> ms per step, one value per repeat."""
    times: dict[tuple[int, int, bool], list[float]] = {c: [] for c in CONFIGS}
    for c in CONFIGS:
        step(model, cache, *c)  # warm-up
    for _ in range(repeats):
        for c in CONFIGS:
            reps = max(2, 8 // c[0])
            t = time.perf_counter()
            for _ in range(reps):
                step(model, cache, *c)
            times[c].append((time.perf_counter() - t) / reps * 1e3)
    return times


def report(path: str, times: dict[tuple[int, int, bool], list[float]]) -> None:
    med = {c: statistics.median(v) for c, v in times.items()}
    print(f"\n{path}: ms per decode step (median [min] of repeats)")
    print(f"  {'sequences x tokens':>18} {'logits':>7} {'ms/step':>9} {'[min]':>9} {'ms per extra sequence':>22}")
    for c in CONFIGS:
        extra = f"{(med[c] - med[CONFIGS[0]]) / (c[0] - 1):22.2f}" if c[0] > 1 else " " * 22
        logits = "all" if c[2] else "1 row"
        print(f"  {f'{c[0]} x {c[1]}':>18} {logits:>7} {med[c]:9.2f} {min(times[c]):9.2f} {extra}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--paths", nargs="+", default=["gguf", "fp32"], choices=["gguf", "fp32"])
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, context {args.context}, {args.repeats} repeats")
    for path in args.paths:
        model = load(path)
        with torch.inference_mode():
            times = measure(model, filled_cache(model, args.context), args.repeats)
        report(path, times)
        del model


if __name__ == "__main__":
    main()
