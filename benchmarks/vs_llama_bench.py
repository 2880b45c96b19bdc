"""Plain decoding of the default GGUF: verispec (dtype auto) against llama.cpp's own `llama-bench`, side by side.

llama.cpp is not a dependency: build its `llama-bench` yourself (cmake, `--target llama-bench`) and pass the binary.
Both run the same file (SmolLM2-135M-Instruct Q4_1) on the same threads, interleaved (llama.cpp, verispec,
llama.cpp, ...), so a noisy neighbour slows both alike.

Conditions (MEASURE.md): concurrency 1, batch 1, greedy; baseline: llama.cpp in the same run; median (min..max) of
--rounds rounds. Two metrics:
- decode tok/s: one stream generating --tokens tokens from an empty context (llama-bench `-p 0 -n N`, its tg test;
  verispec after a BOS-only prompt, ignore_eos, counting decode time after the first token);
- end to end: a --prompt-tokens prompt prefilled, then --tokens generated, (prompt + generated) tokens / wall time
  (llama-bench's `-pg P,N` test, random prompt tokens; verispec: the same number of fixed pseudo-random prompt
  tokens, the whole request timed).

    python benchmarks/vs_llama_bench.py --llama-bench ~/llama.cpp/build/bin/llama-bench [--rounds 5] [--tokens 64]
        [--prompt-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess

import torch

from verispec import LLM, SamplingParams
from verispec.kernels.cpu import cpu_info
from verispec.models import hub
from verispec.models.loader import resolve


def llama_bench_tok_s(binary: str, gguf: str, tokens: int, threads: int, prompt: int = 0) -> float:
    """llama-bench's tokens/s for one repetition: its tg test (decode only) without a prompt, else its pg test
    ((prompt + generated) / time)."""
    test = ["-p", "0", "-n", str(tokens)] if not prompt else ["-p", "0", "-n", "0", "-pg", f"{prompt},{tokens}"]
    out = subprocess.run([binary, "-m", gguf, *test, "-t", str(threads), "-r", "1", "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=600).stdout
    runs = json.loads(out)
    return float(runs[0]["avg_ts"])


def verispec_tok_s(llm: LLM, tokens: int, prompt: int = 0) -> float:
    """Decode tok/s after a BOS-only prompt, or (prompt + generated) tokens / wall time of the whole request."""
    bos = llm.tokenizer.bos_token_id if llm.tokenizer.bos_token_id is not None else 1
    ids = [bos] + [(7919 * i + 13) % llm.model.cfg.vocab_size for i in range(1, prompt)]
    params = SamplingParams(temperature=0, max_tokens=tokens + (0 if prompt else 1), ignore_eos=True)
    out = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
    if not prompt:
        return float(out.stats["decode_tok_per_s"])
    return (len(ids) + len(out.token_ids)) * float(out.stats["tok_per_s"]) / len(out.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bench", required=True, help="path to llama.cpp's llama-bench binary")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length of the end-to-end test")
    args = ap.parse_args()
    threads = torch.get_num_threads()
    gguf = str(resolve(hub.DEFAULT_MODEL, progress=False).gguf)
    llm = LLM(hub.DEFAULT_MODEL, max_num_seqs=1, progress=False)
    verispec_tok_s(llm, 8)  # warm-up
    verispec_tok_s(llm, 8, args.prompt_tokens)
    runs: dict[str, dict[str, list[float]]] = {"decode": {"llama": [], "ours": []}, "e2e": {"llama": [], "ours": []}}
    for _ in range(args.rounds):
        for metric, prompt in (("decode", 0), ("e2e", args.prompt_tokens)):
            runs[metric]["llama"].append(llama_bench_tok_s(args.llama_bench, gguf, args.tokens, threads, prompt))
            runs[metric]["ours"].append(verispec_tok_s(llm, args.tokens, prompt))
    print(f"CPU {cpu_info().label()}; torch {torch.__version__}; {threads} threads; {args.tokens} tokens generated; "
          f"end to end after a {args.prompt_tokens}-token prompt; {args.rounds} interleaved rounds; verispec path "
          f"{llm.path_choice.path.name}")
    print("| metric | llama.cpp llama-bench tok/s | verispec tok/s | verispec / llama.cpp per round |\n|---|---|---|---|")
    for metric, label in (("decode", "decode (ms/token)"), ("e2e", f"end to end, {args.prompt_tokens} + "
                                                                    f"{args.tokens} tokens")):
        ll, ours = runs[metric]["llama"], runs[metric]["ours"]
        ratio = [o / x for o, x in zip(ours, ll)]
        extra = f" ({1000 / statistics.median(ll):.1f} ms)" if metric == "decode" else ""
        extra_ours = f" ({1000 / statistics.median(ours):.1f} ms)" if metric == "decode" else ""
        print(f"| {label} | {_spread(ll)}{extra} | {_spread(ours)}{extra_ours} | x{statistics.median(ratio):.2f} "
              f"({min(ratio):.2f}..{max(ratio):.2f}) |")


def _spread(v: list[float]) -> str:
    return f"{statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f})"

if __name__ == "__main__":
    main()
