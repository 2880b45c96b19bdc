"""How close verispec's CPU kernel runs to this machine's limits: one forward's linears by rows per forward M,
against the int8 dot-product peak and the memory read bandwidth, both measured here in the same run.

Shapes: the default model's 30 layers (q|k|v, o, gate|up, down as Q4_1 blocks) and its Q8_0 head (93 MiB of
weights, more than the last-level cache, streamed as a forward streams them), through `Library.linear` on the
body and prefetch level the loader chose. Linears only: attention, norms and RoPE are not in these figures.

Ceilings, measured by a small C probe built with the kernel's own compiler and vector flags:
  dot peak   multiply-adds per second of the instruction the chosen body's inner loop is made of (AVX-512 VNNI
             `vpdpbusd` on 512 and on 256 bits; AVX2 `vpmaddubsw` with the `vpaddw` that keeps its pairs, which
             overstates what the AVX2 body can do: it widens to 32 bits too), every thread issuing 10 independent
             chains
  block      (AVX-512 VNNI body only) multiply-adds per second of the body's own arithmetic for a 32-element Q4_1
             block against 8 rows, weights in registers: per row 8 `vpdpbusd` on broadcast activations, then a
             convert, a multiply and two FMAs for the block's scales. Not a floor (the floor uses the dot peak):
             what a kernel of this arithmetic could reach with its weights and activations already in registers;
             on a 2-core Zen 4 it measured 326-344 GMAC/s, 70-74% of the `vpdpbusd` peak (2026-12-06)
  read       GB/s of every thread reading its share of a 512 MiB buffer (sum of 64-bit words, vectorised)
Per M: ms of one pass over all 121 weights (median of --repeats, the Ms interleaved, order rotated), the floor (the
larger of reading the weights at the read bandwidth and the multiply-adds at the dot peak) and ms / floor, GMAC/s
and its share of the dot peak (the larger of the two widths) and of the block arithmetic, weight GB/s and its share
of the read bandwidth, and which ceiling is nearer. A share near 100% says a faster kernel has little to find at
that M; the rest of the step (attention, the engine) is then where time goes.

Conditions (MEASURE.md): one process, torch's thread count (all of them issue the peak chains and the reads),
random weights (speed does not depend on the values); metric: ms and rates as above; baseline: the two ceilings
measured in the same run.

    python benchmarks/studies/kernel_roofline.py [--repeats 7] [--ms 1,2,4,8,16,32,64,128] [--json OUT]   (about 5 s)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from verispec.kernels.cpu import cpu_info
from verispec.kernels.cpu_build import build_flags, compiler
from verispec.kernels.cpu_kernels import load
from verispec.kernels.kernel_choice import forward_weights

BLOCK = "Q4_1 block arithmetic"  # not an instruction's peak: what the format's own per-block work allows

PROBE = r"""
#include <stdint.h>
#include <stddef.h>
#include <omp.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#define CHAINS 10
/* multiply-adds per second of `kind` (0 vpdpbusd zmm, 1 vpdpbusd ymm, 2 vpmaddubsw ymm) on `threads` threads */
double dot_rate(int kind, long iters, int threads) {
    double t0 = omp_get_wtime();
    volatile int sink = 0;
    #pragma omp parallel num_threads(threads)
    {
        int s = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512F__)
        if (kind == 0) {
            __m512i a[CHAINS], w = _mm512_set1_epi8(3), x = _mm512_set1_epi8(5);
            for (int i = 0; i < CHAINS; i++) a[i] = _mm512_set1_epi32(i);
            for (long it = 0; it < iters; it++) {
                for (int i = 0; i < CHAINS; i++) a[i] = _mm512_dpbusd_epi32(a[i], w, x);
                __asm__ volatile("" : "+v"(w));
            }
            for (int i = 0; i < CHAINS; i++) s += _mm512_reduce_add_epi32(a[i]);
        }
        if (kind == 1) {
            __m256i a[CHAINS], w = _mm256_set1_epi8(3), x = _mm256_set1_epi8(5);
            for (int i = 0; i < CHAINS; i++) a[i] = _mm256_set1_epi32(i);
            for (long it = 0; it < iters; it++) {
                for (int i = 0; i < CHAINS; i++) a[i] = _mm256_dpbusd_epi32(a[i], w, x);
                __asm__ volatile("" : "+v"(w));
            }
            for (int i = 0; i < CHAINS; i++) s += _mm256_extract_epi32(a[i], 0);
        }
        if (kind == 3) { /* the AVX-512 body's arithmetic per 32-element Q4_1 block, weights in registers: for each of
                            8 rows, 8 vpdpbusd (a broadcast group of 4 activations each) in two chains, then
                            float(sum) x (d x s) into acc and m x (s x sum) into mins */
            int32_t xq[8][8];
            float xs[8], xss[8];
            for (int t = 0; t < 8; t++) {
                for (int k = 0; k < 8; k++) xq[t][k] = 0x01010101 * (t + k + 1);
                xs[t] = 1.0f + t;
                xss[t] = 0.5f * t;
            }
            __m512i wv[8];
            for (int k = 0; k < 8; k++) wv[k] = _mm512_set1_epi8(k + 1);
            __m512 d = _mm512_set1_ps(0.01f), m = _mm512_set1_ps(0.02f), acc[8], mins[8];
            for (int t = 0; t < 8; t++) acc[t] = mins[t] = _mm512_setzero_ps();
            for (long it = 0; it < iters; it++) {
                __asm__ volatile("" : "+v"(wv[0]), "+v"(wv[1]), "+v"(wv[2]), "+v"(wv[3]), "+v"(wv[4]), "+v"(wv[5]),
                                 "+v"(wv[6]), "+v"(wv[7]), "+v"(d), "+v"(m));
                for (int t = 0; t < 8; t++) {
                    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
                    for (int k = 0; k < 8; k += 2) {
                        s0 = _mm512_dpbusd_epi32(s0, wv[k], _mm512_set1_epi32(xq[t][k]));
                        s1 = _mm512_dpbusd_epi32(s1, wv[k + 1], _mm512_set1_epi32(xq[t][k + 1]));
                    }
                    acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)),
                                             _mm512_mul_ps(d, _mm512_set1_ps(xs[t])), acc[t]);
                    mins[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(xss[t]), mins[t]);
                }
            }
            float f = 0.0f;
            for (int t = 0; t < 8; t++) f += _mm512_reduce_add_ps(_mm512_add_ps(acc[t], mins[t]));
            s += (int)f;
        }
#endif
#if defined(__AVX2__)
        if (kind == 2) {
            __m256i a[CHAINS], x[CHAINS], w = _mm256_set1_epi8(3);
            for (int i = 0; i < CHAINS; i++) { a[i] = _mm256_set1_epi16(i); x[i] = _mm256_set1_epi8(i + 1); }
            for (long it = 0; it < iters; it++) {
                for (int i = 0; i < CHAINS; i++) a[i] = _mm256_add_epi16(a[i], _mm256_maddubs_epi16(w, x[i]));
                __asm__ volatile("" : "+v"(w));
            }
            for (int i = 0; i < CHAINS; i++) s += _mm256_extract_epi16(a[i], 0);
        }
#endif
        sink += s;
    }
    const double macs = (double)iters * (kind == 3 ? 8 * 8 * 64 : CHAINS * (kind == 0 ? 64 : 32)) * threads;
    return macs / (omp_get_wtime() - t0);
}
/* bytes per second of reading n 64-bit words, split across `threads` threads */
double read_rate(const uint64_t *p, size_t n, int threads) {
    double t0 = omp_get_wtime();
    uint64_t total = 0;
    #pragma omp parallel for num_threads(threads) reduction(+ : total) schedule(static)
    for (size_t i = 0; i < n; i++) total += p[i];
    const double dt = omp_get_wtime() - t0;
    return total == 1 ? 0.0 : (double)n * 8 / dt;
}
"""
KINDS = {"vpdpbusd zmm": 0, "vpdpbusd ymm": 1, "vpmaddubsw ymm": 2, BLOCK: 3}


def build_probe(tmp: Path) -> ctypes.CDLL:
    cc = compiler()
    if cc is None:
        raise SystemExit("no C compiler: the kernel (and this probe) cannot be built here")
    src, lib = tmp / "probe.c", tmp / "probe.so"
    src.write_text(PROBE)
    flags = [f for f in build_flags() if f != "-ffp-contract=off"]
    subprocess.run([cc, *flags, "-fopenmp", "-o", str(lib), str(src)], check=True, capture_output=True)
    probe = ctypes.CDLL(str(lib))
    probe.dot_rate.restype = probe.read_rate.restype = ctypes.c_double
    probe.dot_rate.argtypes = [ctypes.c_int, ctypes.c_long, ctypes.c_int]
    probe.read_rate.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return probe


def ceilings(probe: ctypes.CDLL, threads: int, body: str, repeats: int = 5) -> dict[str, float]:
    """The best of `repeats` of each: multiply-adds / s per instruction kind the body uses, and read bytes / s."""
    if body == "portable":  # no vector instructions built in: the probe has no dot product to time
        raise SystemExit("the kernel runs its portable body here (no AVX2): there is no vector peak to compare with")
    kinds = ["vpdpbusd zmm", "vpdpbusd ymm", BLOCK] if body == "avx512-vnni" else ["vpmaddubsw ymm"]
    out = {}
    for name in kinds:
        out[name] = max(probe.dot_rate(KINDS[name], 2_000_000, threads) for _ in range(repeats))
    buf = torch.ones(512 * 2 ** 20 // 8, dtype=torch.int64)
    out["read"] = max(probe.read_rate(buf.data_ptr(), buf.numel(), threads) for _ in range(repeats))
    return out


def time_linears(library, weights, ms: list[int], repeats: int) -> dict[int, float]:
    """Median seconds of one pass over `weights` per M, the Ms interleaved (order rotated every repeat)."""
    gen = torch.Generator().manual_seed(0)
    xs = {(m, k): torch.randn(m, k, generator=gen) for m in ms for k in {k for *_, k in weights}}
    outs = {(m, n): torch.empty(m, n) for m in ms for _, _, n, _ in weights}

    def run(m: int) -> float:
        t0 = time.perf_counter()
        for raw, kind, n, k in weights:
            library.linear(raw, kind, n, k, xs[m, k], outs[m, n])
        return time.perf_counter() - t0

    for m in ms:  # warm-up: packing of nothing, but the thread pool and the first touch of every buffer
        run(m)
    times: dict[int, list[float]] = {m: [] for m in ms}
    for r in range(repeats):
        for m in ms[r % len(ms):] + ms[:r % len(ms)]:
            times[m].append(run(m))
    return {m: statistics.median(t) for m, t in times.items()}


def table(weights, secs: dict[int, float], ceil: dict[str, float]) -> list[dict]:
    """Per M: the figures of the module doc, and the floor: the larger of the weights' read time at the measured
    bandwidth and the multiply-adds' time at the dot peak (neither can be beaten; both at once can)."""
    macs_per_row = sum(n * k for _, _, n, k in weights)
    nbytes = sum(raw.numel() for raw, *_ in weights)
    dot_peak = max(v for k, v in ceil.items() if k not in ("read", BLOCK))
    block = ceil.get(BLOCK)
    rows = []
    for m, s in secs.items():
        floor = max(nbytes / ceil["read"], m * macs_per_row / dot_peak)
        gmac, gbs = m * macs_per_row / s / 1e9, nbytes / s / 1e9
        share_dot, share_read = gmac * 1e9 / dot_peak, gbs * 1e9 / ceil["read"]
        rows.append({"M": m, "ms": s * 1e3, "floor_ms": floor * 1e3, "gmac_s": gmac, "dot_share": share_dot,
                     "weight_gb_s": gbs, "read_share": share_read, "block_share": gmac * 1e9 / block if block else None,
                     "nearer": "compute" if share_dot > share_read else "memory"})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64,128")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    ms = [int(m) for m in args.ms.split(",")]
    threads = torch.get_num_threads()
    library = load()
    weights = forward_weights(library)
    with tempfile.TemporaryDirectory() as tmp:
        probe = build_probe(Path(tmp))
        ceil = ceilings(probe, threads, library.body)
        secs = time_linears(library, weights, ms, args.repeats)
        ceil_after = ceilings(probe, threads, library.body)  # the machine may have changed while timing
    ceil = {k: max(v, ceil_after[k]) for k, v in ceil.items()}
    rows = table(weights, secs, ceil)
    cpu = cpu_info()
    print(f"CPU {cpu.label()}; torch {torch.__version__}, {threads} threads")
    print(f"kernel: {library.describe()}")
    dots = ", ".join(f"{k} {v / 1e9:.0f} GMAC/s" for k, v in ceil.items() if k != "read")
    print(f"ceilings (best of 10, before and after): {dots}; read {ceil['read'] / 1e9:.1f} GB/s")
    print(f"weights: {sum(raw.numel() for raw, *_ in weights) / 2 ** 20:.1f} MiB, "
          f"{sum(n * k for _, _, n, k in weights) / 1e6:.1f} M multiply-adds per row; median of {args.repeats}\n")
    block = BLOCK in ceil
    print("| M | ms (linears) | ms per row | floor ms | ms / floor | GMAC/s | share of dot peak | "
          + ("share of block arithmetic | " if block else "") + "weight GB/s | share of read GB/s | nearer |")
    print("|---" * (11 if block else 10) + "|")
    for r in rows:
        print(f"| {r['M']} | {r['ms']:.2f} | {r['ms'] / r['M']:.3f} | {r['floor_ms']:.2f} | "
              f"{r['ms'] / r['floor_ms']:.2f} | {r['gmac_s']:.0f} | {r['dot_share']:.0%} | "
              + (f"{r['block_share']:.0%} | " if block else "")
              + f"{r['weight_gb_s']:.1f} | {r['read_share']:.0%} | {r['nearer']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu.as_dict(), "threads": threads, "kernel": library.describe(),
                                               "ceilings": ceil, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
