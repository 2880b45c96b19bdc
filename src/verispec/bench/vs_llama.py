"""`verispec bench llama`: plain decoding of one GGUF file, verispec (dtype auto) against llama.cpp's own
`llama-bench`, side by side.

llama.cpp is not a dependency: build its `llama-bench` yourself (cmake, `--target llama-bench`) and pass the binary.
Both run the same file (--model: the default model's Q4_1 file, or any .gguf) on the same threads, interleaved (llama.cpp, verispec,
llama.cpp, ...), so a noisy neighbour slows both alike.

Conditions (docs/measuring.md): concurrency 1, batch 1, greedy; baseline: llama.cpp in the same run; median (min..max) of
--repeats rounds. Two metrics:
- decode tok/s: one stream generating --max-tokens tokens from an empty context (llama-bench `-p 0 -n N`, its tg test;
  verispec after a BOS-only prompt, ignore_eos, counting decode time after the first token);
- end to end: a --prompt-tokens prompt prefilled, then --max-tokens generated, (prompt + generated) tokens / wall time
  (llama-bench's `-pg P,N` test, random prompt tokens; verispec: the same number of fixed pseudo-random prompt
  tokens, the whole request timed).

    verispec bench llama --llama-bench ~/llama.cpp/build/bin/llama-bench [--model F.gguf] [--repeats 5]
        [--max-tokens 64] [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics

from verispec.bench.common import add_common_args
from verispec.bench.decode_speed import llama_bench_tok_s, spread, verispec_tok_s


def add_llama_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p, max_tokens=64, repeats=5)
    p.add_argument("--llama-bench", required=True, help="path to llama.cpp's llama-bench binary")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the end-to-end test")
    p.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=True,
                   help="llama-bench -fa 1 (its fastest here; default: on)")


def measure(args: argparse.Namespace) -> tuple[dict[str, dict[str, list[float]]], str]:
    """Per metric (decode, e2e) and engine (llama, ours): tok/s of each interleaved round; and verispec's path."""
    import torch

    from verispec.api import LLM
    from verispec.models.loader import resolve

    threads = torch.get_num_threads()
    resolved = resolve(args.model, progress=False)
    if resolved.gguf is None:
        raise ValueError(f"--model {args.model}: llama-bench needs a .gguf file")
    gguf = str(resolved.gguf)
    llm = LLM(args.model, dtype=args.dtype, device="cpu", max_num_seqs=1, progress=False)
    verispec_tok_s(llm, 8)  # warm-up
    verispec_tok_s(llm, 8, args.prompt_tokens)
    runs: dict[str, dict[str, list[float]]] = {"decode": {"llama": [], "ours": []}, "e2e": {"llama": [], "ours": []}}
    for _ in range(args.repeats):
        for metric, prompt in (("decode", 0), ("e2e", args.prompt_tokens)):
            runs[metric]["llama"].append(llama_bench_tok_s(args.llama_bench, gguf, args.max_tokens, threads, prompt,
                                                               ("-fa", "1" if args.flash_attn else "0")))
            runs[metric]["ours"].append(verispec_tok_s(llm, args.max_tokens, prompt))
    return runs, llm.path_choice.path.name


def run_llama_cli(args: argparse.Namespace) -> int:
    import torch

    from verispec.kernels.cpu import cpu_info

    runs, path = measure(args)
    print(f"CPU {cpu_info().label()}; torch {torch.__version__}; {torch.get_num_threads()} threads; {args.model}; "
          f"{args.max_tokens} tokens generated; end to end after a {args.prompt_tokens}-token prompt; "
          f"{args.repeats} interleaved rounds; verispec path {path}")
    print("| metric | llama.cpp llama-bench tok/s | verispec tok/s | verispec / llama.cpp per round |\n|---|---|---|---|")
    for metric, label in (("decode", "decode (ms/token)"), ("e2e", f"end to end, {args.prompt_tokens} + "
                                                                    f"{args.max_tokens} tokens")):
        ll, ours = runs[metric]["llama"], runs[metric]["ours"]
        ratio = [o / x for o, x in zip(ours, ll)]
        extra = f" ({1000 / statistics.median(ll):.1f} ms)" if metric == "decode" else ""
        extra_ours = f" ({1000 / statistics.median(ours):.1f} ms)" if metric == "decode" else ""
        print(f"| {label} | {spread(ll)}{extra} | {spread(ours)}{extra_ours} | x{statistics.median(ratio):.2f} "
              f"({min(ratio):.2f}..{max(ratio):.2f}) |")
    return 0
