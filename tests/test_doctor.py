"""`verispec doctor`: trained-layout drafters on a tiny target pass every link; each deliberately broken checkpoint
is caught at its own link with its own reason, the later links reported as skipped; the CLI's exit codes.

The broken checkpoints are built independently of the doctor (edited config.json / safetensors files), and the
expected reasons name the exact field and values, so a check that passes everything fails these tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verispec.cli import main
from verispec.doctor.run import STAGES, DoctorOptions, run_doctor
from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts
from verispec.drafters.eagle3 import Eagle3Config, Eagle3Head
from verispec.drafters.eagle3_export import export_from_checkpoint
from verispec.models.loader import load_model

FAST = dict(dtype="float32", max_tokens=6, state_steps=8, scheduler="static")


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path, tmp_path_factory) -> dict:
    """A random tiny target (2 layers, the default model's tokenizer) and random drafters saved in each layout."""
    root = tmp_path_factory.mktemp("doctor")
    target, _ = load_model(str(tiny_dir), dtype="float32", device="cpu", progress=False)
    torch.manual_seed(3)
    head = Eagle3Head(Eagle3Config.for_target(target, (0, 1, 2), draft_vocab_size=64), target)
    with torch.no_grad():
        chosen = torch.arange(10, 74)
        head.d2t.copy_(chosen - torch.arange(64))
        head.t2d[chosen] = True
    head.save_pretrained(root / "eagle3")
    export_from_checkpoint(str(root / "eagle3"), str(root / "export"), dtype=torch.float32)
    cfg = DFlashConfig.for_target(target.cfg, num_layers=1, block_size=4, target_layer_ids=(0,))
    DFlashModel(cfg, TargetParts.of(target)).save_pretrained(root / "dflash")
    dspark = DFlashConfig.for_target(target.cfg, num_layers=1, block_size=4, target_layer_ids=(0,), dspark=True,
                                     markov_rank=8)
    DFlashModel(dspark, TargetParts.of(target)).save_pretrained(root / "dspark")
    return {"root": root, "target": tiny_dir}


def _doctor(target, method: str, drafter, **kw):
    return run_doctor(DoctorOptions(str(target), method, None if drafter is None else str(drafter), **{**FAST, **kw}))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_config(d: Path, edit) -> None:
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))


def _failure(report, name: str, *fragments: str) -> None:
    """The chain failed first at `name` with every fragment in its reason; later links skipped. (The interface
    link reports all its checks, so checks after the failing one may be there too.)"""
    assert not report.ok
    i = next(i for i, c in enumerate(report.checks) if not c.ok)
    last = report.checks[i]
    assert last.name == name, [(c.name, c.ok, c.reason) for c in report.checks]
    for f in fragments:
        assert f in last.reason, last.reason
    assert report.skipped and report.skipped[-1] == "state oracle"


@pytest.mark.parametrize("method,layout", [("eagle3", "eagle3"), ("eagle3", "export"), ("dflash", "dflash"),
                                           ("dspark", "dspark")])
def test_trained_layouts_pass_every_link(tiny, method, layout):
    report = _doctor(tiny["target"], method, tiny["root"] / layout)
    assert report.ok, [(c.name, c.reason) for c in report.checks if not c.ok]
    names = [c.name for c in report.checks]
    assert names[0] == "target architecture" and names[-2:] == ["greedy identity", "state oracle"]
    sched = next(c for c in report.checks if c.name == "verifier and scheduler")
    assert "exact" in sched.detail


def test_dspark_scheduler_names_its_fallback(tiny):
    eagle = _doctor(tiny["target"], "eagle3", tiny["root"] / "eagle3", scheduler="dspark", max_tokens=2,
                    state_steps=2)
    sched = next(c for c in eagle.checks if c.name == "verifier and scheduler")
    assert "gives no confidences" in sched.detail and "online per-position acceptance estimate" in sched.detail
    spark = _doctor(tiny["target"], "dspark", tiny["root"] / "dspark", scheduler="dspark", max_tokens=2,
                    state_steps=2)
    sched = next(c for c in spark.checks if c.name == "verifier and scheduler")
    assert "confidence head" in sched.detail and "uncalibrated" in sched.detail


def test_architecture_that_routes_to_another_class(tiny, tmp_path):
    target = _copy(tiny["target"], tmp_path / "target")
    _edit_config(target, lambda c: c.update(architectures=["Qwen2ForCausalLM"]))  # model_type stays llama
    _failure(_doctor(target, "eagle3", tiny["root"] / "eagle3"), "target architecture",
             "Qwen2ForCausalLM routes to the qwen2 class", "model_type 'llama'")
    assert _doctor(target, "eagle3", tiny["root"] / "eagle3").skipped == STAGES[1:]
    d = _copy(tiny["root"] / "eagle3", tmp_path / "eagle1")
    _edit_config(d, lambda c: c.update(architectures=["LlamaForCausalLMEagle"]))  # EAGLE-1's class in SGLang
    _failure(_doctor(tiny["target"], "eagle3", d), "drafter architecture", "is a eagle checkpoint",
             "LlamaForCausalLMEagle")
    d = _copy(tiny["root"] / "dflash", tmp_path / "dflash-as-eagle3")
    _failure(_doctor(tiny["target"], "eagle3", d), "drafter architecture", "DFlashDraftModel is a dflash checkpoint")


def test_missing_and_extra_config_fields(tiny, tmp_path):
    d = _copy(tiny["root"] / "eagle3", tmp_path / "missing")
    _edit_config(d, lambda c: c.pop("draft_vocab_size"))
    _failure(_doctor(tiny["target"], "eagle3", d), "drafter config fields", "missing ['draft_vocab_size']")
    d = _copy(tiny["root"] / "dflash", tmp_path / "extra")
    _edit_config(d, lambda c: c["verispec_config"].update(mask_token_id=7))
    _failure(_doctor(tiny["target"], "dflash", d), "drafter config fields",
             "verispec_config: unknown ['mask_token_id']")
    d = _copy(tiny["root"] / "dflash", tmp_path / "mirror")
    _edit_config(d, lambda c: c.update(num_hidden_layers=2))
    _failure(_doctor(tiny["target"], "dflash", d), "drafter config fields",
             "num_hidden_layers 2 != verispec_config.num_layers 1")


def test_wrong_hidden_size(tiny, tmp_path):
    d = _copy(tiny["root"] / "eagle3", tmp_path / "hidden")
    _edit_config(d, lambda c: c.update(target_hidden_size=48))
    _failure(_doctor(tiny["target"], "eagle3", d), "interface: hidden size", "target hidden size 48",
             "this target has 32")


def test_layer_ids_out_of_range(tiny, tmp_path):
    d = _copy(tiny["root"] / "eagle3", tmp_path / "layers")
    _edit_config(d, lambda c: c.update(feature_layers=[0, 1, 5]))
    _failure(_doctor(tiny["target"], "eagle3", d), "interface: layer ids", "layer ids [5] are out of range",
             "the target has 2 layers")
    d = _copy(tiny["root"] / "dflash", tmp_path / "dflash-layers")

    def far(c):
        c["verispec_config"]["target_layer_ids"] = [4]
        c["dflash_config"]["target_layer_ids"] = [4]
    _edit_config(d, far)
    _failure(_doctor(tiny["target"], "dflash", d), "interface: layer ids", "layer ids [5] are out of range")


def test_vocabulary_maps_that_do_not_match(tiny, tmp_path):
    d = _copy(tiny["root"] / "eagle3", tmp_path / "maps")
    sd = load_file(str(d / "model.safetensors"))
    sd["t2d"][10] = False  # draft id 0 maps to target id 10, which t2d no longer marks
    sd["t2d"][200] = True
    save_file(sd, str(d / "model.safetensors"))
    _failure(_doctor(tiny["target"], "eagle3", d), "interface: d2t / t2d maps", "d2t and t2d disagree", "[10, 200]")
    d = _copy(tiny["root"] / "eagle3", tmp_path / "vocab")
    _edit_config(d, lambda c: c.update(vocab_size=50000))
    _failure(_doctor(tiny["target"], "eagle3", d), "interface: vocabulary", "50000 ids, the target's 49152")


def test_a_different_tokenizer(tiny, tmp_path):
    d = _copy(tiny["root"] / "eagle3", tmp_path / "tok")
    tok = json.loads((tiny["target"] / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100], list(vocab)[101]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, different meaning
    (d / "tokenizer.json").write_text(json.dumps(tok))
    shutil.copy(tiny["target"] / "tokenizer_config.json", d / "tokenizer_config.json")
    _failure(_doctor(tiny["target"], "eagle3", d), "interface: tokenizer", "differs from the target's")


def test_edited_eagle3_export(tiny, tmp_path):
    d = _copy(tiny["root"] / "export", tmp_path / "aux")
    _edit_config(d, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 1]))  # eagle_config keeps [0, 1, 2]
    _failure(_doctor(tiny["target"], "eagle3", d), "drafter config fields",
             "eagle_config.eagle_aux_hidden_state_layer_ids [0, 1, 2] != eagle_aux_hidden_state_layer_ids [0, 1, 1]")
    d = _copy(tiny["root"] / "export", tmp_path / "theta")
    _edit_config(d, lambda c: c.update(rope_theta=500000.0))
    _failure(_doctor(tiny["target"], "eagle3", d), "interface: RoPE / positions",
             "rope_theta 500000 != the target's 10000")
    d = _copy(tiny["root"] / "export", tmp_path / "inter")
    _edit_config(d, lambda c: c.update(intermediate_size=96))  # the weights stay [64, ...]
    _failure(_doctor(tiny["target"], "eagle3", d), "drafter implementation", "size mismatch", "gate_proj")


def test_cli_exit_codes_and_json(tiny, tmp_path, capsys):
    d = _copy(tiny["root"] / "eagle3", tmp_path / "bad")
    _edit_config(d, lambda c: c.update(feature_layers=[0, 1, 9]))
    assert main(["doctor", "--model", str(tiny["target"]), "--drafter", str(d), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    bad = [c for c in out["checks"] if not c["ok"]]
    assert out["ok"] is False and [c["name"] for c in bad] == ["interface: layer ids"] and "[9]" in bad[0]["reason"]
    assert out["skipped"][0] == "drafter implementation"
    argv = ["doctor", "--model", str(tiny["target"]), "--drafter", str(tiny["root"] / "dflash"), "--method", "dflash",
            "--scheduler", "static", "--max-tokens", "3", "--state-steps", "3"]
    assert main(argv) == 0
    assert "doctor: all links pass" in capsys.readouterr().out
    assert main(["doctor", "--model", str(tiny["target"]), "--state-steps", "0"]) == 2
    with pytest.raises(SystemExit) as e:
        main(["doctor", "--method", "medusa"])
    assert e.value.code == 2


@pytest.mark.slow
def test_real_default_model_with_its_shipped_eagle3(capsys):
    assert main(["doctor", "--method", "eagle3", "--state-steps", "24"]) == 0
    out = capsys.readouterr().out
    assert "VerispecEagle3Head -> ours verispec.drafters.eagle3.Eagle3Head" in out
    assert "reads [2, 15, 27] of 0..30" in out and "doctor: all links pass" in out
