"""Plain decoding of the default GGUF: verispec (dtype auto) against llama.cpp's own `llama-bench`, side by side.

llama.cpp is not a dependency: build its `llama-bench` yourself (cmake, `--target llama-bench`) and pass the binary.
Both run the same file (SmolLM2-135M-Instruct Q4_1) on the same threads, interleaved (llama.cpp, verispec,
llama.cpp, ...), so a noisy neighbour slows both alike.

Conditions (MEASURE.md): concurrency 1, batch 1, greedy; metric: decode tok/s of one stream generating --tokens
tokens after a --prompt-token prompt (llama-bench `-p 0 -n N` after a `-p P` prefill is its tg test, which starts
from an empty context; verispec here generates after a BOS-only prompt, ignore_eos, and counts decode time after the
first token); baseline: llama.cpp in the same run; median (min..max) of --rounds rounds.

    python benchmarks/vs_llama_bench.py --llama-bench ~/llama.cpp/build/bin/llama-bench [--rounds 5] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch

from verispec import LLM, SamplingParams
from verispec.execution.cpu import cpu_info
from verispec.models import hub
from verispec.models.loader import resolve


def llama_bench_tok_s(binary: str, gguf: str, tokens: int, threads: int) -> float:
    """llama-bench's tg tokens/s for one repetition."""
    out = subprocess.run([binary, "-m", gguf, "-p", "0", "-n", str(tokens), "-t", str(threads), "-r", "1", "-o",
                          "json"], capture_output=True, text=True, check=True, timeout=600).stdout
    runs = json.loads(out)
    return float(runs[0]["avg_ts"])


def verispec_tok_s(llm: LLM, tokens: int) -> float:
    bos = llm.tokenizer.bos_token_id if llm.tokenizer.bos_token_id is not None else 1
    params = SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True)
    out = llm.generate({"prompt_token_ids": [bos]}, params, use_tqdm=False)[0]
    return float(out.stats["decode_tok_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="path to llama.cpp's llama-bench binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    threads = torch.get_num_threads()
    gguf = str(resolve(hub.DEFAULT_MODEL, progress=False).gguf)
    llm = LLM(hub.DEFAULT_MODEL, max_num_seqs=1, progress=False)
    verispec_tok_s(llm, 8)  # warm-up
    llama, ours = [], []
    for _ in range(args.rounds):
        llama.append(llama_bench_tok_s(args.llama_bench, gguf, args.tokens, threads))
        ours.append(verispec_tok_s(llm, args.tokens))
    ratio = [o / ll for o, ll in zip(ours, llama)]
    print(f"CPU {cpu_info().label()}; torch {torch.__version__}; {threads} threads; {args.tokens} tokens; "
          f"{args.rounds} interleaved rounds; verispec path {llm.path_choice.path.name}")
    print("| engine | decode tok/s, median (min..max) | ms/token |\n|---|---|---|")
    for name, v in (("llama.cpp llama-bench", llama), (f"verispec ({llm.path_choice.path.name})", ours)):
        print(f"| {name} | {statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f}) | {1000 / statistics.median(v):.1f} |")
    print(f"\nverispec / llama.cpp per round: x{statistics.median(ratio):.2f} ({min(ratio):.2f}..{max(ratio):.2f})")


if __name__ == "__main__":
    main()
