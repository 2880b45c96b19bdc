"""Where a verify block's extra rows go on the default path: one target forward of M new tokens split into the
decoder layers (gguf-q8act: one `vs_decoder` call for all 30 layers, attention included), the output head (the
GGUF's Q8_0 matrix over the whole vocabulary, its norm fused) and the rest (embedding, RoPE tables, addressing).

Conditions (MEASURE.md): concurrency 1 (one sequence, one forward at a time, in process); metric: median ms of
each part over --repeats forwards of M tokens after --context committed tokens, logits for all M rows (as a
verify block computes them), the Ms in a shuffled order every repeat; baseline: M = 1 of the same run. The parts
are timed by wrapping the two calls (`DecoderKernel.run`, `LlamaModel._head`) for the run's length only.

    python benchmarks/studies/verify_split.py [--repeats 60] [--context 256] [--ms 1,2,3,4,5,8]      (a few seconds)
"""

from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import time
from collections import defaultdict

import torch

from verispec import LLM
from verispec.bench.load import MachineLoad
from verispec.models.decoder_kernel import DecoderKernel
from verispec.models.llama import LlamaModel, Segment


@contextlib.contextmanager
def timed(cls: type, name: str, into: dict[str, float], key: str):
    """Inside the block, each call of cls.name leaves its seconds in into[key]."""
    inner = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        out = inner(*args, **kwargs)
        into[key] = time.perf_counter() - t
        return out

    setattr(cls, name, wrapper)
    try:
        yield
    finally:
        setattr(cls, name, inner)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--repeats", type=int, default=60)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--ms", default="1,2,3,4,5,8", help="block sizes M")
    args = ap.parse_args()
    llm = LLM(args.model, dtype="auto", device="cpu", max_model_len=2048, max_num_seqs=1, progress=False)
    model = llm.model
    if model.decoder_kernel is None:
        raise SystemExit(f"path {llm.path_choice.path.name}: not the gguf-q8act decoder kernel this splits")
    ms = [int(x) for x in args.ms.split(",")]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, model.cfg.vocab_size, (args.context + max(ms),), generator=gen)
    cache = model.new_cache(args.context + max(ms))
    slot = cache.allocate()
    model.prefill(ids[: args.context], cache, slot)
    last: dict[str, float] = {}
    parts: dict[tuple[int, str], list[float]] = defaultdict(list)
    rng = random.Random(0)
    load = MachineLoad().start()
    with timed(DecoderKernel, "run", last, "layers"), timed(LlamaModel, "_head", last, "head"), torch.inference_mode():
        for _ in range(args.repeats):
            rng.shuffle(ms)
            for m in ms:
                t = time.perf_counter()
                model(ids[args.context : args.context + m], [Segment(slot, args.context, m)], cache,
                      logits_indices=range(m))
                total = time.perf_counter() - t
                cache.rollback(slot, args.context)
                for key, v in (("forward", total), ("layers", last["layers"]), ("head", last["head"])):
                    parts[(m, key)].append(v * 1e3)
    load.stop()
    print(llm.path_choice.describe())
    print(f"context {args.context}, median of {args.repeats} shuffled repeats; {load.describe()}")
    print("| M | forward ms | decoder layers | output head | rest | forward / M = 1 |")
    print("|---|---|---|---|---|---|")
    med = {k: statistics.median(v) for k, v in parts.items()}
    for m in sorted(ms):
        f, layers, head = med[(m, "forward")], med[(m, "layers")], med[(m, "head")]
        print(f"| {m} | {f:.2f} | {layers:.2f} | {head:.2f} | {f - layers - head:.2f} | "
              f"x{f / med[(1, 'forward')]:.2f} |")


if __name__ == "__main__":
    main()
