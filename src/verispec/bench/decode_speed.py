"""The measurements the plain-decoding benchmarks share (`verispec bench llama`, `bench formats`,
benchmarks/verify_curve.py): llama.cpp's `llama-bench` tokens/s on a GGUF, verispec's decode and end-to-end
tokens/s of one request, one target forward's milliseconds for a block of M tokens, and the median (min..max) they
print.

llama.cpp is never a dependency: the caller passes the path of a `llama-bench` it built.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BOS_FALLBACK = 1


def llama_bench_tok_s(binary: str, gguf: str, tokens: int, threads: int, prompt: int = 0,
                      extra: tuple[str, ...] = ()) -> float:
    """llama-bench's tokens/s for one repetition: its tg test (decode only) without a prompt, else its pg test
    ((prompt + generated) / time). `extra`: more llama-bench flags (e.g. ("-fa", "1"))."""
    test = ["-p", "0", "-n", str(tokens)] if not prompt else ["-p", "0", "-n", "0", "-pg", f"{prompt},{tokens}"]
    out = subprocess.run([binary, "-m", gguf, *test, "-t", str(threads), "-r", "1", *extra, "-o", "json"],
                         capture_output=True, text=True, check=True, timeout=1800).stdout
    return float(json.loads(out)[0]["avg_ts"])


def bos_id(llm: Any) -> int:
    """The model's BOS token id (1 where it has no tokenizer or no BOS)."""
    tok = getattr(llm, "tokenizer", None)
    bos = getattr(tok, "bos_token_id", None) if tok is not None else None
    return int(bos) if bos is not None else BOS_FALLBACK


def verispec_tok_s(llm: Any, tokens: int, prompt: int = 0) -> float:
    """Decode tok/s after a BOS-only prompt (decode time after the first token), or (prompt + generated) tokens /
    wall time of the whole request after a `prompt`-token prompt of fixed pseudo-random tokens."""
    out = generate_once(llm, tokens, prompt)
    if not prompt:
        return float(out.stats["decode_tok_per_s"])
    return (prompt + len(out.token_ids)) * float(out.stats["tok_per_s"]) / len(out.token_ids)


def generate_once(llm: Any, tokens: int, prompt: int = 0, seed: int = 0):
    """One greedy request of `tokens` generated tokens (one more after a BOS-only prompt, so that `tokens` are
    decoded after the first), ignoring EOS; its RequestOutput."""
    from verispec import SamplingParams

    ids = prompt_ids(llm, prompt)
    params = SamplingParams(temperature=0, max_tokens=tokens + (0 if prompt else 1), ignore_eos=True, seed=seed)
    return llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]


def prompt_ids(llm: Any, prompt: int) -> list[int]:
    """BOS, then prompt - 1 fixed pseudo-random tokens."""
    return [bos_id(llm)] + [(7919 * i + 13) % llm.model.cfg.vocab_size for i in range(1, prompt)]


def forward_ms(model, cache, slot: int, ids: "torch.Tensor", context: int, m: int) -> float:
    """ms of one forward of ids[context : context + m] as a block after `context` committed tokens (logits for
    all m rows, as a verify block computes them); the cache rolled back after."""
    from verispec.models.llama import Segment

    t = time.perf_counter()
    model(ids[context : context + m], [Segment(slot, context, m)], cache, logits_indices=range(m))
    ms = (time.perf_counter() - t) * 1e3
    cache.rollback(slot, context)
    return ms


def spread(v: list[float], digits: int = 1) -> str:
    """median (min..max)."""
    return f"{statistics.median(v):.{digits}f} ({min(v):.{digits}f}..{max(v):.{digits}f})"
