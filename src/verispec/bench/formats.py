"""`verispec bench formats`: the GGUF formats people download, and real model shapes: verispec (dtype auto)
against llama.cpp's own `llama-bench` on the same files, side by side, interleaved.

(a) --model (default: the default model's shipped Q4_1 file) re-quantised by llama.cpp's `llama-quantize --allow-requantize` from the shipped Q4_1 file
    to each of --formats (the same weights, as a new user would make them): plain decode tok/s (--tokens after
    BOS; llama-bench `-p 0 -n N -t T -fa 1`) and end to end (--prompt-tokens + --tokens; llama-bench `-pg P,N`);
(b) synthetic GGUFs (random weights, bench/synth_gguf.py) in the shapes of --shapes, quantised by llama-quantize
    to each of --shape-formats: plain decode against llama-bench, the verify curve (ms of one forward of M = 1..16
    tokens after a --context prefix), and speculative decoding with synthetic acceptance at --tau (k = --k; a
    lossy benchmark mode: drafts copied from the target's own earlier output, verified for real) against verispec's
    own plain decoding, interleaved;
(c) peak RSS of one process that loads the largest shape in Q4_K_M and decodes --tokens tokens, against the file
    size plus verispec's KV cache (a fresh process, after the one-time conversion is cached).

llama.cpp is never a dependency: --llama-bin names the build/bin of one you built (llama-bench, llama-quantize;
without llama-bench the llama.cpp columns read n/a, without llama-quantize only Q8_0 shapes are written, by gguf's
own quantizer). The synthetic-acceptance rows run the benchmark-only `synthetic` method (drafters/synthetic.py).

Conditions: concurrency 1, batch 1, greedy; baselines: llama-bench in the same run, on the same file and threads
(parts a, b) and verispec's plain decoding (part b's speculative rows); median (min..max) of --repeats rounds,
llama.cpp and verispec alternating within each round. The path `dtype auto` chose is printed for every file.

    verispec bench formats --llama-bin ~/llama.cpp/build/bin [--parts a,b,c] [--repeats 3] [--work DIR]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from verispec import LLM
from verispec.bench.common import add_common_args
from verispec.bench.decode_speed import forward_ms, generate_once, llama_bench_tok_s, verispec_tok_s
from verispec.bench.decode_speed import spread as _spread
from verispec.bench.load import MachineLoad
from verispec.bench.synth_gguf import SHAPES, quantize, write_gguf
from verispec.drafters.synthetic import LABEL
from verispec.kernels.cpu import cpu_info
from verispec.models import hub
from verispec.models.loader import resolve

FORMATS = ("Q4_0", "Q4_1", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")
FA = ("-fa", "1")  # llama-bench's fastest setting here (flash attention)


def spread(v: list[float]) -> str:
    return _spread(v) if v else "n/a (llama-bench missing)"


def load(path: Path, dtype: str = "auto", max_len: int = 512) -> LLM:
    return LLM(str(path), dtype=dtype, max_num_seqs=1, max_model_len=max_len, progress=False)


def src_kind(path: Path) -> str:
    """The GGML type of a GGUF's first layer's q projection ("Q4_1" for the default model)."""
    from verispec.models.gguf_index import GGUFIndex

    return GGUFIndex.open(path).entry("blk.0.attn_q.weight").kind


def path_line(llm: LLM) -> str:
    return f"{llm.path_choice.path.name} ({llm.path_choice.describe()})"


def versus_llama(args, llm: LLM, gguf: Path, prompt: int) -> dict[str, list[float]]:
    """--rounds rounds of llama-bench then verispec on one metric (prompt 0: decode; else end to end)."""
    runs: dict[str, list[float]] = {"llama": [], "ours": []}
    for _ in range(args.repeats):
        if Path(args.llama_bench).exists():  # else the llama.cpp columns read n/a
            runs["llama"].append(llama_bench_tok_s(args.llama_bench, str(gguf), args.max_tokens, args.threads, prompt,
                                                   FA))
        runs["ours"].append(verispec_tok_s(llm, args.max_tokens, prompt))
    return runs


def ratio_cell(runs: dict[str, list[float]]) -> str:
    if not runs["llama"]:
        return "n/a"
    r = [o / x for o, x in zip(runs["ours"], runs["llama"])]
    return f"x{statistics.median(r):.2f} ({min(r):.2f}..{max(r):.2f})"


def part_a(args, out: dict) -> None:
    src = resolve(args.model, progress=False).gguf
    if src is None:
        raise SystemExit(f"--model {args.model}: part (a) re-quantises a .gguf file")
    print(f"\n## (a) the default model re-quantised from {src.name}\n")
    print("| file | verispec path (dtype auto) | llama-bench decode tok/s | verispec decode tok/s | ratio | "
          f"llama-bench e2e tok/s ({args.prompt_tokens}+{args.max_tokens}) | verispec e2e tok/s | ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for fmt in args.formats:
        dst = src if fmt == src_kind(src) else quantize(args.llama_quantize, src, args.work / f"smollm2-135m-{fmt}.gguf",
                                                 fmt, args.threads, requantize=True)
        llm = load(dst, args.dtype)
        print(f"<!-- {fmt}: {path_line(llm)} -->", file=sys.stderr, flush=True)
        verispec_tok_s(llm, 8), verispec_tok_s(llm, 8, args.prompt_tokens)  # warm-up
        dec, e2e = versus_llama(args, llm, dst, 0), versus_llama(args, llm, dst, args.prompt_tokens)
        out["a"][fmt] = {"path": llm.path_choice.path.name, "decode": dec, "e2e": e2e}
        print(f"| {fmt} | {llm.path_choice.path.name} | {spread(dec['llama'])} | {spread(dec['ours'])} | "
              f"{ratio_cell(dec)} | {spread(e2e['llama'])} | {spread(e2e['ours'])} | {ratio_cell(e2e)} |", flush=True)
        del llm
        gc.collect()


def shape_file(args, shape: str, fmt: str) -> Path:
    """The synthetic file of `shape` in `fmt`: written in F16 once (tokenizer of the default model), quantised by
    llama-quantize; Q8_0 written directly by gguf's quantizer where llama-quantize is missing."""
    tok = resolve(hub.DEFAULT_MODEL, progress=False).gguf
    dst = args.work / f"{shape}-{fmt}.gguf"
    if not Path(args.llama_quantize).exists():
        if fmt != "Q8_0":
            raise SystemExit(f"{args.llama_quantize} is missing: only Q8_0 can be written without it")
        if not dst.exists():
            write_gguf(dst, SHAPES[shape], tokenizer_from=tok, name=shape, float_type="q8_0")
        return dst
    f16 = args.work / f"{shape}-f16.gguf"
    if not f16.exists():
        write_gguf(f16, SHAPES[shape], tokenizer_from=tok, name=shape)
    return quantize(args.llama_quantize, f16, dst, fmt, args.threads)


def verify_curve(args, llm: LLM) -> dict[int, float]:
    """Median ms of one forward of M tokens after --context committed ones, M = 1..16, Ms interleaved."""
    model = llm.model
    ids = torch.arange(args.context + 16) * 7 % model.cfg.vocab_size
    cache = model.new_cache(args.context + 16)
    slot = cache.allocate()
    model.prefill(ids[: args.context], cache, slot)
    times: dict[int, list[float]] = {m: [] for m in range(1, 17)}
    for r in range(args.repeats + 1):
        for m in range(1, 17):
            ms = forward_ms(model, cache, slot, ids, args.context, m)
            if r:
                times[m].append(ms)
    del cache
    return {m: statistics.median(v) for m, v in times.items()}


def speculative(args, llm: LLM) -> dict:
    """Synthetic acceptance at --tau (k = --k) against own plain decoding, rounds interleaved (--spec-tokens
    generated after BOS); the first synthetic run records the continuation the later ones copy."""
    spec = llm.with_speculation({"method": "synthetic", "synthetic_tau": args.tau, "num_speculative_tokens": args.k,
                                 "adaptive": False, "benchmark_only": True})
    generate_once(spec, args.spec_tokens)  # records the target's continuation
    plain_runs, spec_runs, taus, same = [], [], [], True
    for _ in range(args.repeats):
        a = generate_once(llm, args.spec_tokens)
        b = generate_once(spec, args.spec_tokens)
        plain_runs.append(float(a.stats["decode_tok_per_s"]))
        spec_runs.append(float(b.stats["decode_tok_per_s"]))
        taus.append(float(b.stats["mean_acceptance_length"]))
        same &= a.token_ids == b.token_ids
        label = b.stats["synthetic_acceptance"]
    return {"plain": plain_runs, "spec": spec_runs, "tau": taus, "identical": same, "label": label}


def part_b(args, out: dict) -> None:
    print(f"\n## (b) synthetic shapes (random weights), {args.max_tokens} tokens decoded after BOS\n")
    rows, curves, specs = [], [], []
    for shape in args.shapes:
        for fmt in args.shape_formats:
            f = shape_file(args, shape, fmt)
            llm = load(f, args.dtype)
            print(f"<!-- {shape} {fmt}: {path_line(llm)} -->", file=sys.stderr, flush=True)
            verispec_tok_s(llm, 8)
            dec = versus_llama(args, llm, f, 0)
            curve = verify_curve(args, llm)
            sp = speculative(args, llm)
            out["b"][f"{shape} {fmt}"] = {"path": llm.path_choice.path.name, "decode": dec, "verify_ms": curve,
                                          "speculative": sp}
            gb = f.stat().st_size / 1e9  # what one decode step reads: every weight (the head included) once
            read = " | ".join(f"{gb * statistics.median(dec[e]):.1f}" if dec[e] else "n/a" for e in ("llama", "ours"))
            rows.append(f"| {shape} | {fmt} | {llm.path_choice.path.name} | {spread(dec['llama'])} | "
                        f"{spread(dec['ours'])} | {ratio_cell(dec)} | {read} |")
            curves.append(f"| {shape} {fmt} | " + " | ".join(f"{curve[m]:.1f}" for m in range(1, 17)) + " |")
            r = [s / p for s, p in zip(sp["spec"], sp["plain"])]
            specs.append(f"| {shape} {fmt} | {spread(sp['plain'])} | {spread(sp['spec'])} | "
                         f"x{statistics.median(r):.2f} ({min(r):.2f}..{max(r):.2f}) | {statistics.median(sp['tau']):.2f}"
                         f" | {sp['identical']} |")
            for line in (rows[-1], curves[-1], specs[-1]):
                print(line, file=sys.stderr, flush=True)
            del llm
            gc.collect()
    print("GB/s: the file's bytes x decode tok/s, the rate at which an engine streams the weights (a decode step reads "
          "each once); where the two engines' rates meet the machine's memory bandwidth, neither can go faster\n")
    print("| shape | file | verispec path | llama-bench decode tok/s | verispec decode tok/s | ratio | llama-bench GB/s "
          "| verispec GB/s |\n|---|---|---|---|---|---|---|---|\n" + "\n".join(rows))
    print(f"\nverify curve: median ms of one forward of M tokens after {args.context} committed tokens\n")
    print("| file | " + " | ".join(f"M={m}" for m in range(1, 17)) + " |\n|---|" + "---|" * 16 + "\n" + "\n".join(curves))
    print(f"\nsynthetic acceptance at tau {args.tau}, k = {args.k} ({LABEL}); {args.spec_tokens} tokens after BOS; "
          f"baseline: verispec plain on the same file\n")
    print("| file | plain tok/s | speculative tok/s | ratio | tau measured | output == plain |\n|---|---|---|---|---|---|\n"
          + "\n".join(specs))


def part_c(args, out: dict) -> None:
    shape = args.shapes[-1]
    f = shape_file(args, shape, "Q4_K_M")
    load(f, args.dtype)  # converts once (cached), in this process, so that the measured process does not
    gc.collect()
    res = subprocess.run([sys.executable, "-m", "verispec", "bench", "formats", "--rss-of", str(f), "--max-tokens",
                          str(args.max_tokens), "--dtype", args.dtype],
                         capture_output=True, text=True, check=True)
    m = json.loads(res.stdout.strip().splitlines()[-1])
    size = f.stat().st_size
    bound = size + m["kv_bytes"]
    out["c"] = {"file": str(f), "file_bytes": size, **m}
    print(f"\n## (c) peak RSS, {shape} Q4_K_M, {args.max_tokens} tokens decoded (path {m['path']})\n")
    grown = m["peak_rss"] - m["before_rss"]
    print("| peak RSS | file | KV cache | file + KV | RSS / (file + KV) | RSS before the model | peak - before | "
          "(peak - before) / (file + KV) |\n|---|---|---|---|---|---|---|---|")
    print(f"| {m['peak_rss'] / 2**30:.2f} GiB | {size / 2**30:.2f} GiB | {m['kv_bytes'] / 2**20:.0f} MiB | "
          f"{bound / 2**30:.2f} GiB | x{m['peak_rss'] / bound:.2f} | {m['before_rss'] / 2**20:.0f} MiB | "
          f"{grown / 2**30:.2f} GiB | x{grown / bound:.2f} |")
    print("\nRSS before the model: the interpreter with torch and verispec imported, nothing loaded; the model's "
          "load adds its tiles, its tokenizer, the RoPE tables and the KV cache.")


def rss_of(path: str, tokens: int, dtype: str) -> None:
    """(a child process) load `path`, decode `tokens` tokens, print peak RSS, RSS before loading and the KV cache's
    bytes as JSON."""
    before = peak_rss()
    llm = load(Path(path), dtype, max_len=256)
    generate_once(llm, tokens)
    kv = sum(t.nbytes for t in _tensors(llm.cache))
    peak = peak_rss()
    print(json.dumps({"peak_rss": peak, "before_rss": before, "kv_bytes": kv, "path": llm.path_choice.path.name}))


def peak_rss() -> int:
    """This process's peak resident bytes: /proc's VmHWM, which belongs to the address space the process runs now.
    Not getrusage's ru_maxrss: Linux carries that over an exec from the forked copy of the parent, so a child of
    a large benchmark process reports the parent's size before it has loaded anything."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _tensors(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o, depth + 1)
    elif hasattr(obj, "__dict__") and depth < 2:
        for o in vars(obj).values():
            yield from _tensors(o, depth + 1)


def add_formats_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, max_tokens=64, repeats=3)
    p.add_argument("--llama-bin", default=None, help="llama.cpp's build/bin (llama-bench, llama-quantize)")
    p.add_argument("--parts", default="a,b,c", help="a: the model's formats; b: synthetic shapes; c: peak RSS")
    p.add_argument("--formats", default=",".join(FORMATS), help="part (a)'s llama-quantize types")
    p.add_argument("--shapes", default="qwen2.5-0.5b,qwen2.5-1.5b", help=f"part (b)'s shapes, of {', '.join(SHAPES)}")
    p.add_argument("--shape-formats", default="Q4_K_M,Q8_0")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the end-to-end test")
    p.add_argument("--spec-tokens", type=int, default=128, help="tokens per speculative / plain run of part (b)")
    p.add_argument("--context", type=int, default=128, help="committed tokens before the verify curve's block")
    p.add_argument("--tau", type=float, default=3.0, help="synthetic acceptance: mean tokens per verification step")
    p.add_argument("--k", type=int, default=4, help="draft tokens per step with synthetic acceptance")
    p.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "verispec-formats",
                   help="where the quantised and synthetic files are kept")
    p.add_argument("--json", default=None)
    p.add_argument("--rss-of", default=None, help=argparse.SUPPRESS)


def run_formats_cli(args: argparse.Namespace) -> int:
    if args.rss_of:
        rss_of(args.rss_of, args.max_tokens, args.dtype)
        return 0
    if not args.llama_bin:
        raise SystemExit("--llama-bin is required: the build/bin of a llama.cpp you built")
    args.llama_bench = str(Path(args.llama_bin) / "llama-bench")
    args.llama_quantize = str(Path(args.llama_bin) / "llama-quantize")
    args.formats, args.shapes = args.formats.split(","), args.shapes.split(",")
    args.shape_formats, args.threads = args.shape_formats.split(","), torch.get_num_threads()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"CPU {cpu_info().label()}; torch {torch.__version__}; {args.threads} threads; concurrency 1, greedy; "
          f"{args.repeats} interleaved rounds, median (min..max); llama-bench -t {args.threads} -fa 1")
    out: dict = {"a": {}, "b": {}, "c": {}, "cpu": cpu_info().as_dict(), "threads": args.threads}
    load_meter = MachineLoad().start()
    for part, run in (("a", part_a), ("b", part_b), ("c", part_c)):
        if part in args.parts.split(","):
            run(args, out)
    load_meter.stop()
    print("\n" + load_meter.describe())
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0
