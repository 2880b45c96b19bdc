"""Shipped drafters: found by name, documented by a model card, and lossless on the default model."""

from __future__ import annotations

import json

import pytest

from verispec.drafters.shipped import resolve, shipped_names, shipped_root


def test_unknown_drafter_name_says_what_to_do():
    with pytest.raises(FileNotFoundError, match="verispec train"):
        resolve("no-such-drafter")


def test_a_directory_resolves_to_itself(tmp_path):
    assert resolve(str(tmp_path)) == tmp_path


@pytest.mark.parametrize("name", shipped_names())
def test_model_card_states_command_data_time_and_tau(name):
    d = shipped_root() / name
    card = (d / "README.md").read_text()
    for needle in ("verispec train data", "verispec train", "Training:", "tau", "| workload |"):
        assert needle in card, f"{name}'s model card lacks {needle!r}"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.get("architectures"), "config.json must name the architecture"


@pytest.mark.slow
@pytest.mark.parametrize("name", shipped_names())
def test_shipped_drafter_is_lossless_on_the_default_model(name):
    from verispec import LLM, SamplingParams

    method = name.rsplit("-", 1)[-1]
    plain = LLM(dtype="float32", device="cpu", max_model_len=512, progress=False)
    fast = plain.with_speculation({"method": method, "model": name, "num_speculative_tokens": 7,
                                      "adaptive": False}, check_state=True)
    msgs = [[{"role": "user", "content": "Write a Python function that returns the squares of a list."}]]
    params = SamplingParams(temperature=0, max_tokens=32)
    out = fast.chat(msgs, params, use_tqdm=False)[0]
    assert out.token_ids == plain.chat(msgs, params, use_tqdm=False)[0].token_ids
    assert out.stats["mean_acceptance_length"] > 1.0, "a shipped drafter should get drafts accepted"


def test_drafters_list_names_every_shipped_drafter(capsys):
    from verispec.cli import main

    assert main(["drafters", "list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in shipped_names())


def test_shipped_drafters_record_their_method_and_target():
    from verispec.drafters.shipped import shipped_card, shipped_for
    from verispec.models.hub import DEFAULT_MODEL

    assert shipped_names(), "the package ships trained drafters"
    for name in shipped_names():
        method = name.rsplit("-", 1)[-1]
        assert shipped_card(name) == (method, DEFAULT_MODEL)
        assert shipped_for(method, DEFAULT_MODEL.upper()) == name
        assert shipped_for(method, "some-other-model") is None


def test_learned_method_alone_on_another_model_asks_for_a_drafter(tiny_dir):
    from verispec import LLM

    with pytest.raises(ValueError, match="--draft-model"):
        LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False, speculative_config={"method": "eagle3"})


@pytest.mark.slow
def test_learned_method_alone_picks_the_shipped_drafter_on_the_default_model():
    from verispec import LLM, SamplingParams
    from verispec.config import LEARNED_METHODS
    from verispec.models.hub import DEFAULT_MODEL

    plain = LLM(dtype="float32", device="cpu", max_model_len=256, max_num_seqs=1, progress=False)
    prompt, params = {"prompt_token_ids": [1, 2, 3]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = plain.generate(prompt, params, use_tqdm=False)[0].token_ids
    for method in LEARNED_METHODS:
        fast = plain.with_speculation({"method": method, "num_speculative_tokens": 3, "adaptive": False})
        assert fast.spec.model == f"{DEFAULT_MODEL}-{method}"
        out = fast.generate(prompt, params, use_tqdm=False)[0]
        assert out.stats["method"] == method and out.token_ids == ref
        assert out.stats["drafter_weights"] == "float32"  # beside a float32 target the drafter stays float
