"""Training under torchrun: `verispec train dspark` launched on 2 CPU ranks (gloo) keeps the ranks' weights identical
after every step, and every step equals one process accumulating the same micro-batches (each rank's share of the
data, its own generator); a run killed mid-way (SIGKILL) and resumed ends with the same weights as the uninterrupted
run; checkpoints and held-out splits do not depend on the number of ranks; bad resumes are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import self_distilled_data, sharp_llama
from verispec.drafters.dflash import DFlashConfig, DFlashModel, TargetParts
from verispec.train import checkpoint
from verispec.train import dflash as tr
from verispec.train.distributed import Dist
from verispec.train.loop import lr_factor
from verispec.train.share import catalog, rank_data, split

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
STEPS, ACCUM, WORLD = 4, 2, 2
COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    hf, model = sharp_llama(root / "target", 3, **COMMON)
    (root / "data").mkdir()
    data = self_distilled_data(hf, model, root / "target", root / "data", 20, 6, seed=9, response=20)
    return {"root": root, "target": model, "data": data}


def args(setup, out: Path, *extra: str) -> list[str]:
    return ["train", "dspark", "--data", str(setup["data"]), "--out", str(out), "--model", str(setup["root"] /
            "target"), "--device", "cpu", "--layers", "1", "--block-size", "4", "--markov-rank", "8", "--anchors", "4",
            "--batch-seqs", "2", "--accum", str(ACCUM), "--steps", str(STEPS), "--save-every", "1", "--amp", "off",
            *extra]


def launch(argv: list[str], dump: Path, kill_at: int = 0) -> subprocess.CompletedProcess:
    dump.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "DUMP": str(dump), "KILL_AT_STEP": str(kill_at), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}",
           str(ROOT / "tests" / "train_worker.py"), *argv]
    return subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def ddp(setup):
    out, dump = setup["root"] / "ddp-out", setup["root"] / "ddp-dump"
    r = launch(args(setup, out), dump)
    assert r.returncode == 0, r.stderr[-3000:]
    return out, dump


def weights(dump: Path, rank: int, step: int) -> dict[str, torch.Tensor]:
    return torch.load(dump / f"rank{rank}-step{step}.pt")


def test_ranks_hold_identical_weights_after_every_step(ddp):
    out, dump = ddp
    for step in range(STEPS + 1):
        a, b = weights(dump, 0, step), weights(dump, 1, step)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"ranks differ after step {step}"
    assert not all(torch.equal(weights(dump, 0, 0)[k], v) for k, v in weights(dump, 0, STEPS).items())  # it trained
    log = json.loads((out / "train_log.json").read_text())
    assert log["world_size"] == WORLD and log["steps"] == STEPS and "ece_after" in log["calibration"]
    assert (out / "model.safetensors").exists()


def test_each_step_equals_one_process_accumulating_both_ranks_micro_batches(setup, ddp):
    """The reference: one process, one model, both ranks' data shares and generators, the 2 x 2 micro-batches of
    a step accumulated (loss / 4 each), the same AdamW, clipping and learning-rate schedule."""
    out, dump = ddp
    target = setup["target"]
    cfg = DFlashConfig.for_target(target.cfg, num_layers=1, block_size=4, dspark=True, markov_rank=8)
    model = DFlashModel(cfg, TargetParts.of(target, dtype=torch.float32))
    model.load_state_dict(weights(dump, 0, 0), strict=False)
    tc = tr.TrainConfig(steps=STEPS, anchors_per_seq=4, seqs_per_step=2, accum=ACCUM)
    usable = lambda r: tr.has_anchors(r.length, r.prompt_len)  # noqa: E731
    tasks = [tr.BlockTask(model, d.train, d.held, tc) for d in
             (rank_data(setup["data"], Dist(r, WORLD, torch.device("cpu")), cfg.feature_layers, tc.heldout_frac,
                        tc.seed, usable) for r in range(WORLD))]
    gens = [torch.Generator().manual_seed(tc.seed * 7919 + r) for r in range(WORLD)]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=tc.lr, weight_decay=tc.weight_decay, betas=(0.9, 0.95))
    losses = []
    model.train()
    for step in range(STEPS):
        for g in opt.param_groups:
            g["lr"] = tc.lr * lr_factor(step, step / STEPS, tc.warmup)
        opt.zero_grad()
        total = 0.0
        for task, gen in zip(tasks, gens):
            for _ in range(ACCUM):
                loss, _ = task.loss(task.sample(gen))
                (loss / (ACCUM * WORLD)).backward()
                total += float(loss.detach()) / (ACCUM * WORLD)
        torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
        opt.step()
        losses.append(total)
        got = weights(dump, 0, step + 1)
        for name, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(got[name], p.detach(), atol=2e-6, rtol=1e-5, msg=f"{name}, step {step}")
    log = json.loads((out / "train_log.json").read_text())
    assert log["loss"] == pytest.approx(losses, abs=1e-4)


def test_killed_and_resumed_run_ends_like_the_uninterrupted_one(setup, ddp):
    _, dump = ddp
    out = setup["root"] / "resume-out"
    killed = launch(args(setup, out), setup["root"] / "killed-dump", kill_at=3)
    assert killed.returncode != 0
    assert checkpoint.latest(out).name == "step-0000002"  # step 3 was taken but never written
    again = launch(args(setup, out), setup["root"] / "resumed-dump")
    assert again.returncode == 0, again.stderr[-3000:]
    log = json.loads((out / "train_log.json").read_text())
    assert log["resumed_at"] == [2] and log["steps"] == STEPS
    want, got = weights(dump, 0, STEPS), weights(setup["root"] / "resumed-dump", 0, STEPS)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=0, msg=name)
    assert len(log["loss"]) == STEPS and log["loss"][:2] == json.loads((ddp[0] / "train_log.json").read_text())[
        "loss"][:2]


def test_resume_refuses_another_world_size_or_other_arguments(setup, ddp):
    out = ddp[0]
    with pytest.raises(ValueError, match="written by 2 ranks"):
        tr.run(_parse(args(setup, out)), "dspark")
    changed = args(setup, out)
    changed[changed.index("--markov-rank") + 1] = "4"
    with pytest.raises(ValueError, match="different run"):
        tr.run(_parse(changed), "dspark")


def _parse(argv: list[str]):
    from verispec.cli import build_parser

    return build_parser().parse_args(argv)


def test_the_heldout_split_does_not_depend_on_the_world_size(setup):
    refs = catalog(setup["data"])
    assert len(refs) == 20 and [r.index for r in refs[:7]] == [0, 1, 2, 3, 4, 5, 0]
    train, held = split(refs, 0.1, 0)
    seen = {1: set(), 2: set(), 3: set()}
    for world in seen:
        for r in range(world):
            d = rank_data(setup["data"], Dist(r, world, torch.device("cpu")), [2], 0.1, 0)
            assert d.train_total == len(train) and d.held_total == len(held) == 2
            seen[world] |= {tuple(s.ids.tolist()) for s in d.held}
    assert seen[1] == seen[2] == seen[3] and len(seen[1]) == 2


def test_eagle3_under_torchrun_counts_the_vocabulary_over_all_ranks(setup):
    """EAGLE-3's draft vocabulary comes from response-token counts summed over the ranks: both ranks build the
    same one, equal to counting every training sequence in one process, and stay in step while training."""
    from safetensors.torch import load_file

    from verispec.train.eagle3 import build_vocab

    out, dump = setup["root"] / "eagle3-out", setup["root"] / "eagle3-dump"
    r = launch(["train", "eagle3", "--data", str(setup["data"]), "--out", str(out), "--model", str(setup["root"] /
                "target"), "--device", "cpu", "--draft-vocab", "24", "--ttt-steps", "2", "--updates", "2", "--batch", "2",
                "--intermediate-size", "32", "--max-len", "64", "--eval-every", "1"], dump)
    assert r.returncode == 0, r.stderr[-3000:]
    for step in range(3):
        a, b = weights(dump, 0, step), weights(dump, 1, step)
        assert all(torch.equal(a[k], b[k]) for k in a), f"ranks differ after step {step}"
    usable = [x for x in catalog(setup["data"]) if min(x.length, 64) - x.prompt_len >= 2]
    train, _ = split(usable, 0.05, 0)
    from verispec.train.share import load

    d2t, _ = build_vocab(load(setup["data"], train, []), 24, COMMON["vocab_size"])
    assert torch.equal(load_file(str(out / "model.safetensors"))["d2t"], d2t)
    info = json.loads((out / "train_log.json").read_text())
    assert info["world_size"] == WORLD and info["sequences_per_update"] == 2 * WORLD and info["updates"] == 2
