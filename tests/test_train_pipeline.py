"""The whole learned-drafter pipeline on the real default model, in CI's --quick mode: `verispec train data` ->
`train eagle3 | dflash | dspark --quick` -> `export-eagle3` -> speculative generation whose greedy output equals
plain decoding (fp32), with the state oracle on. Tiny drafters, so this proves the plumbing, not the speed."""

from __future__ import annotations

import json

import pytest

from verispec import LLM, SamplingParams
from verispec.cli import main
from verispec.train.shards import read_meta

pytestmark = pytest.mark.slow
PROMPTS = [[{"role": "user", "content": "List three fruits as a JSON array."}],
           [{"role": "user", "content": "Write a Python function that adds two numbers."}]]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    data = root / "data"
    assert main(["train", "data", "--out", str(data), "--limit", "4", "--max-tokens", "24", "--modes", "greedy,sampled",
                 "--shard-size", "4", "--max-num-seqs", "4"]) == 0
    for method in ("eagle3", "dflash", "dspark"):
        extra = [] if method == "eagle3" else ["--steps", "8"]
        extra += [] if method == "dflash" else ["--holdout", "0.25"]  # dflash keeps its default share, 0.1
        assert main(["train", method, "--data", str(data), "--out", str(root / method), "--quick", *extra]) == 0
    return root


def test_data_and_checkpoints(pipeline):
    meta = read_meta(pipeline / "data")
    assert meta["num_sequences"] == 8 and meta["shards"] == [0, 1] and meta["modes"] == ["greedy", "sampled"]
    for method in ("eagle3", "dflash", "dspark"):
        assert (pipeline / method / "model.safetensors").exists() and (pipeline / method / "config.json").exists()
        assert (pipeline / method / "train_log.json").exists()


def test_holdout_share(pipeline):
    """--holdout sets how many of the 8 sequences the learning curve is measured on (0.25: 2); without it each
    method keeps its default share (DFlash 0.1: 1)."""
    held = {m: json.loads((pipeline / m / "train_log.json").read_text())["heldout_sequences"]
            for m in ("eagle3", "dflash", "dspark")}
    assert held == {"eagle3": 2, "dflash": 1, "dspark": 2}


def test_holdout_refused_outside_0_1(tmp_path, capsys):
    for bad in ("0", "1.5", "x"):
        with pytest.raises(SystemExit):
            main(["train", "eagle3", "--data", str(tmp_path), "--out", str(tmp_path / "o"), "--holdout", bad])
        assert "--holdout must be" in capsys.readouterr().err


def test_export_eagle3(pipeline):
    assert main(["train", "export-eagle3", str(pipeline / "eagle3"), str(pipeline / "export")]) == 0
    conf = json.loads((pipeline / "export" / "config.json").read_text())
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"]
    assert conf["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # (2, L//2, L-3) for the 30-layer target


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark"])
def test_trained_drafter_output_equals_plain(pipeline, method):
    plain = LLM(dtype="float32", device="cpu", max_model_len=512, progress=False)
    fast = plain.with_speculation({"method": method, "model": str(pipeline / method), "num_speculative_tokens": 4},
                                  check_state=True)
    params = SamplingParams(temperature=0, max_tokens=16)
    want = [o.token_ids for o in plain.chat(PROMPTS, params, use_tqdm=False)]
    got = fast.chat(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in got] == want
    assert all(o.stats["method"] == method for o in got)


@pytest.mark.parametrize("method, fmt", [("dspark", "speculators"), ("dflash", "dflash")])
def test_export_dflash_and_dspark(pipeline, method, fmt):
    from safetensors import safe_open

    out = pipeline / f"export-{method}"
    assert main(["train", "export-dflash", str(pipeline / method), str(out), "--format", fmt]) == 0
    conf = json.loads((out / "config.json").read_text())
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= names
    if fmt == "speculators":
        assert conf["speculators_model_type"] == "dspark" and conf["aux_hidden_state_layer_ids"]
        assert {"embed_tokens.weight", "markov_head.markov_w1.weight", "confidence_head.proj.bias"} <= names
    else:
        assert conf["architectures"] == ["DFlashDraftModel"] and (out / "mask_embedding.pt").exists()
        assert conf["dflash_config"]["mask_token_id"] == 2  # SmolLM2's <|im_end|>, its first EOS id
