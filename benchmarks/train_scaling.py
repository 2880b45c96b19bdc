"""Training throughput on one process against torchrun ranks on the same machine, through the real command line.

Conditions (MEASURE.md):
  - Work: `verispec train <method>` on a data directory of the default model (`verispec train data`), --steps
    optimizer steps from scratch (--no-resume, no checkpoint until the end), fp32 on CPU (or each rank's GPU).
  - Metric: trained positions per second of step time (train_log.json `train_tokens_per_s`: the positions that
    carry a loss, summed over ranks, over the mean per-rank time inside optimizer steps; evaluation excluded).
    Every rank runs the same per-rank batch, so W ranks train W times the sequences per step.
  - Baseline: one process with every core (OMP threads = cores); W ranks get cores // W threads each. Runs are
    interleaved world by world within each repeat; medians over --repeats, ratios to the baseline's median.

    python benchmarks/train_scaling.py --data DIR --method dflash --steps 20 --worlds 1,2 --repeats 3
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


def run_once(data: str, method: str, steps: int, world: int, threads: int, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as out:
        argv = ["train", method, "--data", data, "--out", out, "--steps", str(steps), "--no-resume",
                "--save-every", "0", *extra]
        if method == "eagle3":
            argv = ["train", method, "--data", data, "--out", out, "--updates", str(steps), "--no-resume",
                    "--save-every", "0", "--eval-every", str(10 * steps), *extra]
        launcher = [sys.executable, "-m", "verispec"] if world == 1 else \
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}", "-m",
             "verispec"]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        r = subprocess.run(launcher + argv, env=env, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"world {world} failed:\n{r.stderr[-3000:]}")
        log = json.loads((Path(out) / "train_log.json").read_text())
    tps = log.get("train_tokens_per_s")
    return {"world": world, "threads": threads, "tokens_per_s": tps, "loss_last": log.get("loss", log.get("curve"))[-1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--method", default="dflash", choices=["eagle3", "dflash", "dspark"])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--worlds", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cores", type=int, default=os.cpu_count())
    ap.add_argument("--out", default=None, help="write the raw runs and the summary as JSON here")
    ap.add_argument("extra", nargs="*", help="more `verispec train <method>` options, after --")
    a = ap.parse_args()
    worlds = [int(w) for w in a.worlds.split(",")]
    runs = []
    for rep in range(a.repeats):
        for w in worlds:
            r = run_once(a.data, a.method, a.steps, w, max(1, a.cores // w), a.extra)
            runs.append({"repeat": rep, **r})
            print(f"repeat {rep} world {w} ({r['threads']} threads/rank): {r['tokens_per_s']:.0f} tokens/s", flush=True)
    med = {w: statistics.median(r["tokens_per_s"] for r in runs if r["world"] == w) for w in worlds}
    print(f"\n{a.method}, {a.steps} steps, {a.cores} cores, medians of {a.repeats}:")
    print("| ranks | threads/rank | train tokens/s | x vs 1 process |")
    print("|---|---|---|---|")
    for w in worlds:
        print(f"| {w} | {max(1, a.cores // w)} | {med[w]:.0f} | x{med[w] / med[worlds[0]]:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"runs": runs, "median_tokens_per_s": med, "method": a.method,
                                           "steps": a.steps, "cores": a.cores}, indent=1))


if __name__ == "__main__":
    main()
