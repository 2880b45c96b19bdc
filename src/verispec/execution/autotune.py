"""`dtype="auto"`: choose the weight path by measuring this machine, not by a hard-coded guess.

For each candidate path (execution/paths.py) a short profile times the target's linear layers at its own shapes
(one decoder layer's qkv, o, gate_up and down, scaled by the number of layers, plus the output head) for
M = 1, 4, 8 and 16 tokens per forward, with random weights in the path's format, at the current thread count:
about a second in all. Linear layers are where the paths differ; attention and element-wise work are about the
same on all. The table is cached per machine (CPU model and flags, torch version, threads, shapes) under the
verispec cache, so the measurement is paid once.

The expected cost of a step is the mean over the engine's typical block sizes: M = 1 when it decodes plainly,
M = 1 and M = k + 1 when it speculates k tokens (the schedulers shorten drafts where they fail, so both ends
occur). The path with the least expected cost wins; one engine then runs that one path for plain and verify
steps alike, so speculative output equals plain output on it.
"""

from __future__ import annotations

import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import torch

from verispec.config import ModelConfig
from verispec.kernels.cpu import CpuInfo, cpu_info, machine_busy
from verispec.execution.paths import WeightPath
from verispec.models.loader import parse_dtype

PROFILE_M = (1, 4, 8, 16)  # tokens per forward the profile times
REPEATS = 5  # timed rounds per M after a warm-up; each path keeps its fastest


@dataclass(frozen=True)
class PathChoice:
    path: WeightPath
    blocks: tuple[int, ...]  # the block sizes the expected cost averages over
    table: dict[str, dict[int, float]]  # path name -> M -> ms of the linears of one forward
    cpu: CpuInfo
    cached: bool  # the table came from the cache
    explicit: bool = False  # the user named the path; nothing was measured
    expected: dict[str, float] = field(default_factory=dict)  # path name -> expected ms per step

    def _kernel(self):
        """verispec's CPU kernel library where this path runs on it (gguf-q8act), else None."""
        if self.path.quantization != "gguf-q8act":
            return None
        from verispec.kernels.cpu_kernels import load

        return load()

    def describe(self) -> str:
        lib = self._kernel()
        kernel = f"; verispec's kernel: {lib.describe()}" if lib else ""
        if self.explicit:
            return f"path {self.path.name} ({self.path.note}), as asked; CPU {self.cpu.label()}{kernel}"
        costs = ", ".join(f"{n} {ms:.1f}" for n, ms in sorted(self.expected.items(), key=lambda kv: kv[1]))
        how = "cached profile" if self.cached else "measured now"
        return (f"path {self.path.name} ({self.path.note}) chosen by dtype=auto on CPU {self.cpu.label()}: "
                f"expected ms of the linears per step at M={'/'.join(map(str, self.blocks))}: {costs} ({how})"
                f"{kernel}")

    def as_dict(self) -> dict[str, object]:
        out = {**self.path.as_dict(), **self.cpu.as_dict(), "path_chosen_by": "explicit" if self.explicit else "auto"}
        lib = self._kernel()
        if lib:  # which of verispec's matmul bodies ran (the same bits in each)
            out["kernel_body"] = lib.body
            if lib.prefetch_choice:  # where its pair streams were fetched ahead to (measured at load; the level in
                out["kernel_prefetch"] = lib.prefetch_now()  # force: the machine's or the loaded model's)
                out["kernel_pair_rows"] = lib.lib.vs_set_pair_rows(0)  # from how many rows on (the threshold in force)
            if lib.row_prefetch_choice:  # and its streams of fewer rows
                out["kernel_row_prefetch"] = lib.row_prefetch_now()
        return out


def typical_blocks(num_speculative_tokens: int) -> tuple[int, ...]:
    """The block sizes a step of this engine usually verifies: 1 (plain) or 1 and k + 1 (speculative)."""
    return (1,) if num_speculative_tokens <= 0 else (1, num_speculative_tokens + 1)


def expected_cost(table: dict[int, float], blocks: Sequence[int]) -> float:
    """Mean ms over `blocks`, each interpolated linearly in M between the profiled sizes (beyond the largest,
    proportional to M: a pessimistic guess, since the curves flatten)."""
    ms = sorted(table)

    def at(m: int) -> float:
        if m <= ms[0]:
            return table[ms[0]]
        if m >= ms[-1]:
            return table[ms[-1]] * m / ms[-1]
        lo, hi = max(x for x in ms if x <= m), min(x for x in ms if x >= m)
        return table[lo] if lo == hi else table[lo] + (table[hi] - table[lo]) * (m - lo) / (hi - lo)

    return statistics.fmean(at(m) for m in blocks)


def choose(candidates: Sequence[WeightPath], table: dict[str, dict[int, float]], blocks: Sequence[int],
           cpu: CpuInfo, cached: bool) -> PathChoice:
    """The candidate with the least expected cost; ties (within 5 %) go to the earlier, more exact candidate."""
    expected = {p.name: expected_cost(table[p.name], blocks) for p in candidates}
    best = candidates[0]
    for p in candidates[1:]:
        if expected[p.name] < 0.95 * expected[best.name]:
            best = p
    return PathChoice(best, tuple(blocks), table, cpu, cached, expected=expected)


def linear_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(N, K) of one decoder layer's fused linears: qkv, o, gate_up, down."""
    d, q_out, kv_out = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return [(q_out + 2 * kv_out, d), (d, q_out), (2 * cfg.intermediate_size, d), (d, cfg.intermediate_size)]


STREAM_BYTES = 64 * 2**20  # weights cycled through per timed pass: more than a last-level cache holds


def _random_blocks(kind: str, n: int, k: int, seed: int):
    """An [N, K] `Q8ActWeight` of random GGUF blocks of `kind` (quants random, every fp16 scale and min small and
    finite), or of Q4_1 where K is not whole blocks of it."""
    import numpy as np

    from verispec.kernels.q8act import FILE_BLOCKS, Q8ActWeight

    elems, size = FILE_BLOCKS[kind]
    if k % elems:
        kind, (elems, size) = "Q4_1", FILE_BLOCKS["Q4_1"]
    raw = np.random.default_rng(seed).integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    at = 208 if kind == "Q6_K" else 0  # where the block's fp16 d (and min) are
    raw[:, :, at : at + 4 if at == 0 else at + 2] = np.frombuffer(
        np.array([0.01, -0.02], np.float16).tobytes(), np.uint8)[: 4 if at == 0 else 2]
    return Q8ActWeight(raw.reshape(n, -1), kind, n, k)


def _linear_fn(path: WeightPath, n: int, k: int, seed: int, kind: str = "Q4_1"
               ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """An [N, K] linear in the path's format (gguf-q8act: GGUF blocks of `kind`) with random weights: (x [M, K] ->
    [M, N], its bytes)."""
    from verispec.kernels.int4 import GROUP, N_MULTIPLE, Int4Weight

    dtype = parse_dtype(path.dtype)
    g = torch.Generator().manual_seed(seed)
    if path.quantization == "gguf-q8act":
        q = _random_blocks(kind, n, k, seed)
        return q.matmul, q.tiles.numel()
    if path.quantization == "gguf" and n % N_MULTIPLE == 0 and k % GROUP == 0:

        w = Int4Weight(torch.randint(0, 16, (n, k), generator=g), torch.rand(n, k // GROUP, generator=g) / 50,
                       torch.zeros(n, k // GROUP), dtype=dtype)
        return w.matmul, w.packed.numel() * w.packed.element_size() + w.scale_zero.numel() * 2
    dense = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    return (lambda x: torch.nn.functional.linear(x, dense)), dense.numel() * dense.element_size()


def head_rows(cfg: ModelConfig, bytes_per_weight: float) -> int:
    """Rows of the timed head: as many as stream STREAM_BYTES (more than a last-level cache holds, as the whole
    head does), at most the vocabulary. Its time is scaled to the vocabulary: a dense [150k, d] fp32 head is most
    of a gigabyte, which the profile must not add to a quantised model's memory."""
    return min(cfg.vocab_size, max(1024, int(STREAM_BYTES / (cfg.hidden_size * bytes_per_weight)) + 1))


def _head_fn(path: WeightPath, cfg: ModelConfig, kind: str = "Q8_0"
             ) -> tuple[Callable[[torch.Tensor], torch.Tensor], int]:
    """The output head as the path runs it (GGUF blocks of `kind` on verispec's kernel for gguf-q8act, else dense),
    `head_rows` of its rows: (x -> logits of those rows, how many rows)."""
    if path.quantization == "gguf-q8act":
        from verispec.kernels.q8act import FILE_BLOCKS

        elems, size = FILE_BLOCKS[kind]
        rows = head_rows(cfg, size / elems)
        return _random_blocks(kind, rows, cfg.hidden_size, 7).matmul, rows
    dtype = parse_dtype(path.dtype)
    rows = head_rows(cfg, torch.empty(0, dtype=dtype).element_size())
    head = (torch.randn(rows, cfg.hidden_size) / cfg.hidden_size**0.5).to(dtype)
    return (lambda x: torch.nn.functional.linear(x, head)), rows


class _PathBench:
    """One path's linears with random weights: a layer's linears in as many distinct copies as fill STREAM_BYTES
    (at most num_layers), so they come from memory as in a real forward and not from a cache one small layer
    fits in, and the output head as the path runs it. `kinds`: the GGUF's formats of qkv, o, gate_up, down and the
    head (models/quantized.py's `gguf_block_linears`), which gguf-q8act is timed in (default Q4_1, Q8_0 head)."""

    def __init__(self, path: WeightPath, cfg: ModelConfig, kinds: Mapping[str, str] | None = None) -> None:
        self.cfg, self.dtype, self.shapes = cfg, parse_dtype(path.dtype), linear_shapes(cfg)
        fmt = [(kinds or {}).get(f, "Q4_1") for f in ("qkv", "o", "gate_up", "down")]
        first = [_linear_fn(path, n, k, i, fmt[i]) for i, (n, k) in enumerate(self.shapes)]
        self.copies = max(1, min(cfg.num_layers, STREAM_BYTES // max(1, sum(b for _, b in first))))
        self.layers = [[f for f, _ in first]] + [
            [_linear_fn(path, n, k, 97 * c + i, fmt[i])[0] for i, (n, k) in enumerate(self.shapes)]
            for c in range(1, self.copies)]
        self.head, self.head_rows = _head_fn(path, cfg, (kinds or {}).get("head", "Q8_0"))

    def forward_ms(self, m: int) -> float:
        """ms of one forward's linears at M = m: the layer copies' time / copies x num_layers, plus the head."""
        xs = [torch.randn(m, k).to(self.dtype) for _, k in self.shapes]
        h = torch.randn(m, self.cfg.hidden_size).to(self.dtype)
        t0 = time.perf_counter()
        for fs in self.layers:
            for f, x in zip(fs, xs):
                f(x)
        t1 = time.perf_counter()
        self.head(h)
        t2 = time.perf_counter()
        head = (t2 - t1) * self.cfg.vocab_size / self.head_rows
        return ((t1 - t0) / self.copies * self.cfg.num_layers + head) * 1e3


def measure_paths(paths: Sequence[WeightPath], cfg: ModelConfig,
                  kinds: Mapping[str, str] | None = None) -> dict[str, dict[int, float]]:
    """path name -> M -> ms of one forward's linears. The paths are timed interleaved, REPEATS rounds after a
    warm-up round, and each keeps its fastest round: another process stealing the CPU slows a round, never
    speeds one, so the minimum is the measurement least disturbed on a shared machine."""
    benches = {p.name: _PathBench(p, cfg, kinds) for p in paths}
    out: dict[str, dict[int, float]] = {p.name: {} for p in paths}
    with torch.inference_mode():
        for m in PROFILE_M:
            for b in benches.values():
                b.forward_ms(m)  # warm-up: packing, allocator, thread pool
            for _ in range(REPEATS):
                for name, b in benches.items():
                    ms = b.forward_ms(m)
                    out[name][m] = min(out[name].get(m, ms), ms)
    return out


def profile_key(cfg: ModelConfig, device: str, paths: Sequence[WeightPath],
                kinds: Mapping[str, str] | None = None) -> str:
    """What makes a profile valid: this CPU and torch, the thread count, the shapes, the paths (and the source of
    verispec's own kernel, when a path runs it)."""
    cpu = cpu_info()
    parts = [cpu.model, " ".join(cpu.flags), cpu.capability, torch.__version__, str(torch.get_num_threads()),
             device, str(linear_shapes(cfg)), str((cfg.num_layers, cfg.vocab_size, cfg.hidden_size)),
             ",".join(p.name for p in paths), str(PROFILE_M), "head streamed in part"]
    if any(p.quantization == "gguf-q8act" for p in paths):
        from verispec.kernels.cpu_build import source_digest

        parts.append(source_digest())
        if kinds:  # the GGUF's block formats the path was timed in
            parts.append(str(sorted(kinds.items())))
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:20]


def profile_paths(cfg: ModelConfig, device: str, paths: Sequence[WeightPath], cache: Path | None,
                  refresh: bool = False, kinds: Mapping[str, str] | None = None, write: bool = True
                  ) -> tuple[dict[str, dict[int, float]], bool]:
    """(path name -> M -> ms, whether it came from the cache). A single candidate is not measured. `write`: keep
    a new measurement in the cache (not one taken on a busy machine; a cached one is read either way)."""
    if len(paths) == 1:
        return {paths[0].name: {m: float(m) for m in PROFILE_M}}, False
    file = None if cache is None else cache / "kernels" / f"{profile_key(cfg, device, paths, kinds)}.json"
    if file is not None and file.exists() and not refresh:
        raw = json.loads(file.read_text())
        return {p: {int(m): ms for m, ms in t.items()} for p, t in raw["table"].items()}, True
    table = measure_paths(paths, cfg, kinds)
    if file is not None and write:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_suffix(".tmp")
        tmp.write_text(json.dumps({"cpu": cpu_info().as_dict(), "torch": torch.__version__,
                                   "threads": torch.get_num_threads(), "measured": time.time(), "table": table},
                                  indent=1))
        tmp.replace(file)
    return table, False


def resolve_path(dtype: str, quantization: str | None, device: str, cfg: ModelConfig, gguf_int4: bool,
                 num_speculative_tokens: int = 0, cache: Path | None = None, refresh: bool = False,
                 invariant_only: bool = False, gguf_blocks: bool | Mapping[str, str] | None = None) -> PathChoice:
    """The weight path a model runs on. An explicit dtype (or quantization) names it; dtype="auto" measures
    the candidates for this model, device and CPU (cached per machine) and takes the cheapest expected step.
    `invariant_only` leaves out dense fp32 on CPU, whose GEMM rounds rows by batch size (execution/invariance.py
    then checks the chosen path on its own weights). `gguf_blocks`: whether the GGUF's linears are in formats
    verispec's kernel runs (default `gguf_int4`); a mapping of their formats (models/quantized.py's
    `gguf_block_linears`) also says what to time gguf-q8act in."""
    from verispec.execution.paths import candidates, path_for

    cpu = cpu_info()
    if dtype != "auto" or quantization is not None:
        explicit = path_for("bfloat16" if dtype == "auto" else dtype, quantization)
        return PathChoice(explicit, (), {}, cpu, cached=False, explicit=True)
    paths = [p for p in candidates(device, gguf_int4, gguf_blocks) if not (invariant_only and p.name == "fp32")]
    kinds = gguf_blocks if isinstance(gguf_blocks, Mapping) else None
    # a busy machine reads a profile measured quietly before, and measures (uncached) only where there is none
    table, cached = profile_paths(cfg, device, paths, cache, refresh, kinds, write=not machine_busy())
    return choose(paths, table, typical_blocks(num_speculative_tokens), cpu, cached)
