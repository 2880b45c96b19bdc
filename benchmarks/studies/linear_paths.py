"""The default model's linear layers per kernel path, by rows per forward M: what a verify block of M tokens costs.

Shapes: per layer qkv 576 -> 960 (q, k, v fused), o 576 -> 576, gate_up 576 -> 3072 (fused), down 1536 -> 576;
times 30 layers, with the real weights of the default GGUF (Q4_1 blocks). Paths:
  dense fp32     F.linear on gguf's fp32 dequantisation (the engine's default)
  dense bf16     F.linear on the same weights rounded to bf16
  int4 bf16      kernels/int4.py's Int4Weight from the GGUF's own Q4_1 blocks (no requantisation)
  int8 bf16      aten._weight_int8pack_mm, weights requantised per output channel (lossy; a timing reference)
  q8act fp32     kernels/q8act.py's Q8ActWeight: the GGUF's own blocks on verispec's CPU kernel, activations rounded
                 to int8 per 32 values (the gguf-q8act path; skipped where the kernel cannot be built)
Per M, the paths run interleaved (order rotated every repeat); the table gives the median ms of one pass over all
120 linears, cost(M)/cost(1) and the ratio to dense fp32 at the same M. The batch-invariance table gives, per path,
the max |diff| between a row's output alone and the same row inside a batch of M other random rows (0 = bitwise).

    python benchmarks/studies/linear_paths.py [--repeats 5] [--threads 1] [--json OUT]     (about 30 s)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from gguf import GGUFReader

from verispec.kernels.int4 import Int4Weight
from verispec.kernels.cpu import cpu_info
from verispec.models.gguf_blocks import Blocks, read_blocks

MS = (1, 2, 4, 8, 16, 32)
INVARIANCE_MS = (2, 4, 8, 16)
# per layer: (name, the GGUF tensors fused along N)
LINEARS = (("qkv", ("attn_q", "attn_k", "attn_v")), ("o", ("attn_output",)),
           ("gate_up", ("ffn_gate", "ffn_up")), ("down", ("ffn_down",)))

Linear = Callable[[torch.Tensor], torch.Tensor]  # x [M, K] -> [M, N]


def _int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float32 -> (int8 [N, K], bf16 scales [N]), symmetric per output row."""
    s = w.abs().amax(1).clamp_min(1e-12) / 127  # [N]
    return torch.round(w / s[:, None]).clamp(-127, 127).to(torch.int8), s.bfloat16()


def layer_paths(reader: GGUFReader, layer: int) -> dict[str, list[tuple[int, Linear]]]:
    """path -> this layer's 4 linears as (K, x -> y) in the path's arithmetic."""
    q8act = _q8act_available()
    names = ("dense fp32", "dense bf16", "int4 bf16", "int8 bf16") + (("q8act fp32",) if q8act else ())
    out: dict[str, list[tuple[int, Linear]]] = {p: [] for p in names}
    for _, parts in LINEARS:
        blocks: list[Blocks] = [read_blocks(reader, f"blk.{layer}.{p}.weight") for p in parts]
        w32 = torch.cat([torch.from_numpy(b.dequantize()) for b in blocks])  # [N, K]
        w16 = w32.bfloat16()
        i4 = Int4Weight.from_q4([(b.q, b.scale, b.min) for b in blocks], dtype=torch.bfloat16)
        q8, s8 = _int8_per_channel(w32)
        k = w32.shape[1]
        out["dense fp32"].append((k, lambda x, w=w32: F.linear(x, w)))
        out["dense bf16"].append((k, lambda x, w=w16: F.linear(x, w)))
        out["int4 bf16"].append((k, i4.matmul))
        out["int8 bf16"].append((k, lambda x, q=q8, s=s8: torch.ops.aten._weight_int8pack_mm(x, q, s)))
        if q8act:
            from verispec.kernels.q8act import Q8ActWeight
            from verispec.models.gguf_blocks import raw_rows

            rows = [raw_rows(reader, f"blk.{layer}.{p}.weight")[:2] for p in parts]
            out["q8act fp32"].append((k, Q8ActWeight.stacked(rows, k).matmul))
    return out


def _q8act_available() -> bool:
    from verispec.kernels.cpu_kernels import fast_kernel_available

    return fast_kernel_available()[0]


PATH_DTYPE = {"dense fp32": torch.float32, "dense bf16": torch.bfloat16, "int4 bf16": torch.bfloat16,
              "int8 bf16": torch.bfloat16, "q8act fp32": torch.float32}


def all_paths(gguf_path: Path, layers: int) -> dict[str, list[tuple[int, Linear]]]:
    reader = GGUFReader(str(gguf_path))
    paths: dict[str, list[tuple[int, Linear]]] = {}
    for i in range(layers):
        for name, lins in layer_paths(reader, i).items():
            paths.setdefault(name, []).extend(lins)
    return paths


def one_pass(lins: list[tuple[int, Linear]], xs: dict[int, torch.Tensor]) -> float:
    """Seconds for every linear once on its input xs[K] ([M, K])."""
    t = time.perf_counter()
    for k, f in lins:
        f(xs[k])
    return time.perf_counter() - t


def time_paths(paths: dict[str, list[tuple[int, Linear]]], repeats: int) -> dict[str, dict[int, float]]:
    """path -> M -> median ms of one pass; per M the paths run interleaved, their order rotated each repeat."""
    names = list(paths)
    out: dict[str, dict[int, float]] = {n: {} for n in names}
    for m in MS:
        xs = {n: {k: torch.randn(m, k).to(PATH_DTYPE[n]) for k in (576, 1536)} for n in names}  # [M, K]
        times: dict[str, list[float]] = {n: [] for n in names}
        for n in names:  # warm-up
            one_pass(paths[n], xs[n])
        for r in range(repeats):
            for n in names[r % len(names):] + names[: r % len(names)]:
                times[n].append(one_pass(paths[n], xs[n]))
        for n in names:
            out[n][m] = statistics.median(times[n]) * 1e3
    return out


def invariance(paths: dict[str, list[tuple[int, Linear]]], layer_linears: int = 4) -> dict[str, dict[int, float]]:
    """path -> M -> max |y(row alone) - y(row inside M random rows)| over layer 0's linears and 3 positions."""
    gen = torch.Generator().manual_seed(0)
    out: dict[str, dict[int, float]] = {}
    for n, lins in paths.items():
        out[n] = {}
        for m in INVARIANCE_MS:
            worst = 0.0
            for k, f in lins[:layer_linears]:
                row = torch.randn(1, k, generator=gen).to(PATH_DTYPE[n])  # [1, K]
                alone = f(row)[0].float()  # [N]
                for pos in sorted({0, m // 2, m - 1}):
                    x = torch.randn(m, k, generator=gen).to(PATH_DTYPE[n])  # [M, K]
                    x[pos] = row[0]
                    worst = max(worst, (f(x)[pos].float() - alone).abs().max().item())
            out[n][m] = worst
    return out


def print_tables(ms: dict[str, dict[int, float]], inv: dict[str, dict[int, float]], layers: int) -> None:
    print(f"\n{layers} layers x (qkv, o, gate_up, down): median ms per pass; cost(M)/cost(1); vs dense fp32 at M")
    print(f"{'path':12s} {'M':>3s} {'ms':>9s} {'cost/c(1)':>10s} {'vs fp32':>8s}")
    for n, row in ms.items():
        for m, v in row.items():
            print(f"{n:12s} {m:3d} {v:9.2f} {v / row[1]:10.2f} {v / ms['dense fp32'][m]:8.2f}")
    print("\nbatch invariance: max |y(row alone) - y(row among M random rows)| (0 = bitwise identical)")
    print(f"{'path':12s}" + "".join(f"{'M=' + str(m):>10s}" for m in INVARIANCE_MS))
    for n, row in inv.items():
        print(f"{n:12s}" + "".join(f"{v:10.1e}" if v else f"{'0':>10s}" for v in row.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch's default). Default 1: on a loaded 2-core machine each "
                         "multi-threaded call waited a scheduler slice (~8 ms) at its barrier, swamping the kernels")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--gguf", type=Path, default=None, help="default: the default model's GGUF")
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    gguf_path = a.gguf or _default_gguf()
    env = {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": cpu_info().label(),
           "gguf": str(gguf_path), "layers": a.layers, "repeats": a.repeats}
    print(json.dumps(env))
    torch.manual_seed(0)
    with torch.inference_mode():
        paths = all_paths(gguf_path, a.layers)
        ms = time_paths(paths, a.repeats)
        inv = invariance(paths)
    print_tables(ms, inv, a.layers)
    if a.json:
        a.json.write_text(json.dumps({"env": env, "ms": ms, "invariance": inv}, indent=1))


def _default_gguf() -> Path:
    from verispec.models.hub import DEFAULT_MODEL
    from verispec.models.loader import resolve

    path = resolve(DEFAULT_MODEL, progress=False).gguf
    assert path is not None
    return path


if __name__ == "__main__":
    main()
