"""Training throughput on one process against torchrun ranks on the same machine, through the real command line.

Conditions (MEASURE.md):
  - Work: `verispec train <method>` on a data directory of the default model (`verispec train data`), --steps
    optimizer steps from scratch (--no-resume, no checkpoint until the end), on CPU (or each rank's GPU), in each
    precision of --amps (`--amp`: off = float32; bf16 = bf16 autocast, float32 master weights).
  - Metric: trained positions per second of step time (train_log.json `train_tokens_per_s`: the positions that
    carry a loss, summed over ranks, over the mean per-rank time inside optimizer steps; evaluation excluded).
    Every rank runs the same per-rank batch, so W ranks train W times the sequences per step.
  - Baseline: one process with every core (OMP threads = cores) in the first precision of --amps; W ranks get
    cores // W threads each. Runs are interleaved (world, precision) by (world, precision) within each repeat;
    medians over --repeats, ratios to the baseline's median; the last loss of each run beside it.

    python benchmarks/studies/train_scaling.py --data DIR --method dflash --steps 20 --worlds 1,2 --repeats 3
    python benchmarks/studies/train_scaling.py --data DIR --method eagle3 --steps 24 --worlds 1 --amps off,bf16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_once(data: str, method: str, steps: int, world: int, threads: int, amp: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        argv = ["train", method, "--data", data, "--out", out, "--steps", str(steps), "--no-resume",
                "--save-every", "0", "--amp", amp, *extra]
        if method == "eagle3":
            argv = ["train", method, "--data", data, "--out", out, "--updates", str(steps), "--no-resume",
                    "--save-every", "0", "--eval-every", str(10 * steps), "--amp", amp, *extra]
        launcher = [sys.executable, "-m", "verispec"] if world == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
             "verispec"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(launcher + argv, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"world {world} failed:\n{r.stderr[-3000:]}")
        log = json.loads((Path(out) / "train_log.json").read_text())
    tps = log.get("train_tokens_per_s")
    return {"world": world, "threads": threads, "amp": log.get("amp", amp), "tokens_per_s": tps,
            "loss_last": log.get("loss", log.get("curve"))[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--method", default="dflash", choices=["eagle3", "dflash", "dspark"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--amps", default="off", help="precisions to run (`--amp` values: off, bf16, auto)")
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None, help="write the raw runs and the summary as JSON here")
    ap.add_argument("extra", nargs="*", help="more `verispec train <method>` options, after --")
    a = ap.parse_args()
    arms = [(int(w), amp) for w in a.worlds.split(",") for amp in a.amps.split(",")]
    runs = []
    for rep in range(a.repeats):
        for w, amp in arms:
            r = run_once(a.data, a.method, a.steps, w, max(1, a.cores // w), amp, a.extra)
            runs.append({"repeat": rep, "arm": [w, amp], **r})
            print(f"repeat {rep} world {w} ({r['threads']} threads/rank) amp {r['amp']}: {r['tokens_per_s']:.0f} "
                  f"tokens/s, last loss {r['loss_last']:.3f}", flush=True)
    of = lambda arm, key: [r[key] for r in runs if r["arm"] == list(arm)]  # noqa: E731
    med = {arm: statistics.median(of(arm, "tokens_per_s")) for arm in arms}
    print(f"\n{a.method}, {a.steps} steps, {a.cores} cores, medians of {a.repeats}:")
    print("| ranks | threads/rank | amp | train tokens/s | x vs the first row | last loss (median) |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        print(f"| {arm[0]} | {max(1, a.cores // arm[0])} | {of(arm, 'amp')[0]} | {med[arm]:.0f} | "
              f"x{med[arm] / med[arms[0]]:.2f} | {statistics.median(of(arm, 'loss_last')):.3f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"runs": runs, "median_tokens_per_s": {f"{w} {amp}": v for (w, amp), v in
                                           med.items()}, "method": a.method, "steps": a.steps, "cores": a.cores},
                                          indent=1))


if __name__ == "__main__":
    main()
