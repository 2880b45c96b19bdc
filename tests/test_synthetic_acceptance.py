"""Synthetic acceptance (method `synthetic`, benchmark-only): the measured tau lands on the set value, the output
is the target's own (HF transformers' greedy continuation: the verification is real, the cut drafts rejected),
the outputs are labelled lossy, and the mode is refused without its benchmark flag and by generate and serve."""

from __future__ import annotations

import argparse

import pytest
import torch

from tests.helpers import hf_greedy
from verispec import LLM, SamplingParams
from verispec.drafters.synthetic import conditional_acceptance

PROMPTS = [[1, 2, 3, 4], [30, 31, 32, 33, 34, 35]]
TOKENS = 120


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(3)
    cfg = Qwen2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # clear top-1 margins: the greedy reference is not a near-tie lottery
    d = tmp_path_factory.mktemp("tiny-synth")
    hf.save_pretrained(d)
    return str(d), hf


@pytest.mark.parametrize("k, tau", [(4, 1.0), (4, 3.0), (4, 5.0), (2, 2.5), (8, 4.0)])
def test_conditional_acceptance_sums_to_tau(k, tau):
    p = conditional_acceptance(tau, k)
    assert abs(sum(p ** i for i in range(k + 1)) - tau) < 1e-9


@pytest.mark.parametrize("tau", [2.0, 3.0, 4.0])
def test_measured_tau_matches_and_output_is_the_targets(tiny, tau):
    directory, hf = tiny
    llm = LLM(directory, dtype="float32", progress=False, max_num_seqs=1,
              speculative_config={"method": "synthetic", "synthetic_tau": tau, "num_speculative_tokens": 4,
                                  "adaptive": False, "benchmark_only": True})
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
    first = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in PROMPTS]
    assert all(o.stats["num_draft_tokens"] == 0 for o in first)  # nothing recorded yet: plain decoding
    again = [llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0] for p in PROMPTS]
    accepted = sum(o.stats["num_accepted_tokens"] for o in again)
    steps = sum(o.stats["steps"] for o in again)
    measured = 1 + accepted / steps
    assert abs(measured - tau) <= 0.1, (measured, tau)  # low-discrepancy draws: within ~1 / steps
    for prompt, a, b in zip(PROMPTS, first, again):
        assert b.token_ids == a.token_ids == hf_greedy(hf, prompt, TOKENS)
        assert b.stats["lossy"] is True and "lossy benchmark mode" in b.stats["synthetic_acceptance"]
    if tau < 5:
        assert sum(o.stats["num_draft_tokens"] for o in again) > accepted  # some drafts were cut and rejected


def test_refused_without_the_benchmark_flag(tiny):
    directory, _ = tiny
    with pytest.raises(ValueError, match="benchmark-only"):
        LLM(directory, dtype="float32", progress=False,
            speculative_config={"method": "synthetic", "synthetic_tau": 3.0})
    with pytest.raises(ValueError, match="synthetic_tau"):
        LLM(directory, dtype="float32", progress=False,
            speculative_config={"method": "synthetic", "synthetic_tau": 9.0, "benchmark_only": True})


def test_generate_and_serve_refuse_it():
    from verispec.cli import _spec_config, build_parser

    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):  # not a --method choice
            build_parser().parse_args([command, "--method", "synthetic"])
    args = argparse.Namespace(
        speculative_config='{"method": "synthetic", "synthetic_tau": 3, "benchmark_only": true}', method="none",
        num_speculative_tokens=None, draft_model=None, hybrid=None, draft_quantization=None, no_adaptive=False)
    with pytest.raises(ValueError, match="lossy benchmark mode"):
        _spec_config(args)
