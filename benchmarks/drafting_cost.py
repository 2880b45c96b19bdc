"""What one DFlash / DSpark proposal costs beside a gguf-q8act target: the kernel path (drafters/dflash_kernel.py,
and DSpark's greedy walk with U_k as the residual of W2's kernel call, MarkovHead.greedy) against the torch ops over
the same rounded weights (each layer's separate linears, torch norms, RoPE and attention; `decode` with argmax),
side by side in one process.

Conditions (MEASURE.md): concurrency 1 (one drafter, one proposal at a time); metric: median ms per call of each
piece (the context K/V of 2 newly committed positions, the block forward with the 7-row output head, the greedy
decoding of 7 positions) and of the whole proposal; baseline: the torch path, interleaved with the kernel path in
every repeat (order alternated); contexts: real ones, the target's greedy answers to the first prompts of each
workload, anchors spread over each answer. Also: how often both paths draft the same tokens (they round
differently, so near-ties may differ; the target verifies either).

    python benchmarks/drafting_cost.py --drafters smollm2-135m-instruct-dspark,smollm2-135m-instruct-dflash
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
from verispec.drafters.features import take
from verispec.execution.sampling import argmax_rows

GREEDY = SamplingParams(temperature=0)


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
def one_call(model, kernel, ids: list[int], feats: torch.Tensor, n: int, k: int) -> tuple[dict, list[int]]:
    """One proposal at anchor position n (context: n committed positions, the last 2 caught up in the timed call),
    on the kernel path (`kernel`) or the torch one; -> ms per piece, the drafted tokens."""
    model.kernel = kernel
    d = DFlashDrafter(model, GREEDY)
    d.add_features(feats[: n - 2])
    d._catch_up()
    d.add_features(feats[n - 2 : n])
    ms = {}
    t0 = time.perf_counter()
    d._catch_up()
    t1 = time.perf_counter()
    h, U = d.block(ids[n], n)
    t2 = time.perf_counter()
    g = min(k, model.cfg.block_size - 1)
    if model.markov is None:
        toks = argmax_rows(U[:g])
    elif kernel is not None:
        toks = model.markov.greedy(U[:g], h[1 : g + 1], ids[n])[0]
    else:
        t, _, _ = model.markov.decode(U[None, :g], h[None, 1 : g + 1], torch.tensor([ids[n]]),
                                      lambda z, _k: z.argmax(-1))
        toks = t[0].tolist()
    t3 = time.perf_counter()
    ms["context K/V (2 positions)"], ms["block + head"] = 1e3 * (t1 - t0), 1e3 * (t2 - t1)
    ms["greedy decoding"], ms["whole proposal"] = 1e3 * (t3 - t2), 1e3 * (t3 - t0)
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
    print("| drafter | piece | torch ms (median) | kernel ms (median) | torch / kernel |")
    print("|---|---|---|---|---|")
    for name in args.drafters.split(","):
        model = load(shipped.resolve(name), llm.model)
        kernel = model.kernel
        ctxs = contexts(llm, model.cfg.feature_layers, args.workloads.split(","), args.limit, 128)
        times: dict[str, dict[str, list[float]]] = {"torch": defaultdict(list), "kernel": defaultdict(list)}
        same = total = 0
        for ids, feats, p in ctxs:
            span = len(ids) - p - 1
            for a in range(args.anchors):
                n = p + (a * span) // args.anchors
                for r in range(args.repeats + 1):  # repeat 0 warms up
                    drafted = {}
                    for path in (("torch", "kernel") if r % 2 else ("kernel", "torch")):
                        ms, drafted[path] = one_call(model, kernel if path == "kernel" else None, ids, feats, n,
                                                     args.k)
                        for piece, v in ms.items():
                            if r:
                                times[path][piece].append(v)
                    if r == 1:
                        same += sum(x == y for x, y in zip(drafted["torch"], drafted["kernel"]))
                        total += len(drafted["kernel"])
        model.kernel = kernel
        for piece in times["kernel"]:
            a, b = statistics.median(times["torch"][piece]), statistics.median(times["kernel"][piece])
            print(f"| {name} | {piece} | {a:.2f} | {b:.2f} | x{a / b:.2f} |")
        print(f"| {name} | same drafted tokens | {same}/{total} ({100 * same / max(total, 1):.1f}%) | | |")
    load_meter.stop()
    print(f"\n{len(ctxs)} answers x {args.anchors} anchors x {args.repeats} repeats per path; "
          f"{load_meter.describe()}")


if __name__ == "__main__":
    main()
