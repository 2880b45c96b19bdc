"""What one DFlash / DSpark proposal costs beside a gguf-q8act target, three arms side by side in one process:
`torch` (the drafter's layers as torch ops over its rounded weights: separate linears, torch norms, RoPE and
attention), `kernel` (drafters/dflash_kernel.py: a few kernel calls per layer, the context K/V of every layer in
two linears) and, for a checkpoint with a draft vocabulary, `kernel + vocab` (drafters/draft_vocab.py: the head's
and DSpark's W2 rows of the draft tokens only). Every arm computes the logits of the rows asked for only and
DSpark's greedy walk with U_k as the residual of W2's kernel call (MarkovHead.greedy).

Conditions (MEASURE.md): concurrency 1 (one drafter, one proposal at a time); metric: median ms per call of each
piece (the context K/V of 2 newly committed positions, the block forward, the logits and greedy decoding of k = 7
positions: the proposal's time less a block forward) and of the whole proposal; baseline: the torch arm,
interleaved with the others in every repeat (order rotated); contexts: real ones, the target's greedy answers to
the first prompts of each workload, anchors spread over each answer. Also: how often each arm drafts the torch
arm's tokens (they round differently, so near-ties may differ; the target verifies either).

    python benchmarks/studies/drafting_cost.py --drafters smollm2-135m-instruct-dspark,smollm2-135m-instruct-dflash
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from verispec import LLM, SamplingParams
from verispec.bench.load import MachineLoad
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.drafters import shipped
from verispec.drafters.dflash import DFlashDrafter, load
from verispec.execution.features import take

GREEDY = SamplingParams(temperature=0)
ARMS = ("torch", "kernel", "kernel + vocab")


def contexts(llm: LLM, layers: tuple[int, ...], workloads: list[str], limit: int, max_tokens: int):
    """[(token ids, features [n, len(layers) d])]: prompt + the target's greedy answer, features from one prefill."""
    out = []
    for w in workloads:
        for wp in load_workload(w, limit=limit):
            o = llm.chat([list(wp.messages)], SamplingParams(temperature=0, max_tokens=max_tokens),
                         use_tqdm=False)[0]
            ids = list(o.prompt_token_ids) + list(o.outputs[0].token_ids)
            _, _, fwd = llm.model.prefill_fresh(ids, capture_layers=layers)
            feats = take(fwd, layers, slice(0, len(ids))).clone()  # [n, len(layers) d]
            out.append((ids, feats, len(o.prompt_token_ids)))
    return out


@torch.inference_mode()
def one_call(model, arm: tuple, ids: list[int], feats: torch.Tensor, n: int, k: int) -> tuple[dict, list[int]]:
    """One proposal at anchor position n (context: n committed positions, the last 2 caught up in the timed call)
    on `arm` = (kernel or None, draft vocabulary or None); -> ms per piece, the drafted tokens."""
    model.kernel, model.vocab = arm
    d = DFlashDrafter(model, GREEDY)
    d.add_features(feats[: n - 2])
    d._catch_up()
    d.add_features(feats[n - 2 : n])
    t0 = time.perf_counter()
    d._catch_up()
    t1 = time.perf_counter()
    d.hidden(ids[n], n)
    t2 = time.perf_counter()
    toks = d.propose(ids[: n + 1], k).tokens  # the block forward again, then the logits and the greedy decoding
    t3 = time.perf_counter()
    block, rest = t2 - t1, (t3 - t2) - (t2 - t1)
    ms = {"context K/V (2 positions)": 1e3 * (t1 - t0), "block forward": 1e3 * block,
          "logits and greedy decoding": 1e3 * rest, "whole proposal": 1e3 * (t1 - t0 + t3 - t2)}
    return ms, list(toks)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafters", default="smollm2-135m-instruct-dspark,smollm2-135m-instruct-dflash",
                    help="comma list of shipped DFlash / DSpark names or checkpoint directories")
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--limit", type=int, default=1, help="prompts per workload")
    ap.add_argument("--anchors", type=int, default=8, help="anchor positions per answer")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--k", type=int, default=7)
    args = ap.parse_args()
    llm = LLM(args.model, dtype="auto", device="cpu", max_model_len=2048, progress=False)
    if llm.model.decoder_kernel is None:
        raise SystemExit(f"the target runs the {llm.path_choice.path.name} path, not gguf-q8act: the drafters' "
                         "kernel path is not used here")
    load_meter = MachineLoad().start()
    print("| drafter | piece | " + " | ".join(f"{a} ms (median)" for a in ARMS) + " | torch / the last arm |")
    print("|---|---|" + "---|" * len(ARMS) + "---|")
    for name in args.drafters.split(","):
        model = load(shipped.resolve(name), llm.model)
        arms = {"torch": (None, None), "kernel": (model.kernel, None), "kernel + vocab": (model.kernel, model.vocab)}
        if model.vocab is None:
            del arms["kernel + vocab"]
        ctxs = contexts(llm, model.cfg.feature_layers, args.workloads.split(","), args.limit, 128)
        times: dict[str, dict[str, list[float]]] = {a: defaultdict(list) for a in arms}
        same = {a: 0 for a in arms}
        total = 0
        for ids, feats, p in ctxs:
            span = len(ids) - p - 1
            for a in range(args.anchors):
                n = p + (a * span) // args.anchors
                for r in range(args.repeats + 1):  # repeat 0 warms up
                    drafted = {}
                    order = list(arms)[r % len(arms):] + list(arms)[: r % len(arms)]
                    for arm in order:
                        ms, drafted[arm] = one_call(model, arms[arm], ids, feats, n, args.k)
                        for piece, v in ms.items():
                            if r:
                                times[arm][piece].append(v)
                    if r == 1:
                        for arm in arms:
                            same[arm] += sum(x == y for x, y in zip(drafted["torch"], drafted[arm]))
                        total += len(drafted["torch"])
        model.kernel, model.vocab = arms["kernel + vocab"] if "kernel + vocab" in arms else arms["kernel"]
        for piece in times["kernel"]:
            med = {a: statistics.median(times[a][piece]) for a in arms}
            cells = " | ".join(f"{med[a]:.2f}" if a in med else "" for a in ARMS)
            print(f"| {name} | {piece} | {cells} | x{med['torch'] / med[list(arms)[-1]]:.2f} |")
        cells = " | ".join(f"{same[a]}/{total}" if a in same else "" for a in ARMS)
        print(f"| {name} | drafted tokens equal to the torch arm's | {cells} | |")
    load_meter.stop()
    print(f"\n{len(ctxs)} answers x {args.anchors} anchors x {args.repeats} repeats per path; "
          f"{load_meter.describe()}")


if __name__ == "__main__":
    main()
