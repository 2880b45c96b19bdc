"""Greedy equality: every drafter's output is token-identical to plain decoding (fp32).

Tiny random models here; the real default model over the shipped workloads in test_greedy_identity_default.py.
A divergence fails the test unless the target's top-1/top-2 margin there is a near-tie (< 1e-3).
"""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.check.identity import compare_greedy

METHODS = ["ngram", "suffix", "draft_model"]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

    common = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    out = {}
    for name, cfg in {"llama": LlamaConfig(**common), "mistral-window": MistralConfig(**common, sliding_window=5),
                      "qwen3": Qwen3Config(**common)}.items():
        torch.manual_seed(len(name))
        d = tmp_path_factory.mktemp(name)
        m = AutoModelForCausalLM.from_config(cfg)
        with torch.no_grad():
            m.lm_head.weight.mul_(4.0)  # sharper distributions: long repeated runs for the drafters to find
        m.save_pretrained(d)
        out[name] = str(d)
    torch.manual_seed(99)
    draft = tmp_path_factory.mktemp("draft")
    AutoModelForCausalLM.from_config(LlamaConfig(**{**common, "num_hidden_layers": 1})).save_pretrained(draft)
    out["draft"] = str(draft)
    return out


PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7, 7], [10, 20, 30, 10, 20, 30, 10], list(range(40, 50))]


@pytest.mark.parametrize("arch", ["llama", "mistral-window", "qwen3"])
@pytest.mark.parametrize("method", METHODS)
def test_speculative_greedy_equals_plain(tiny_dirs, arch, method):
    plain = LLM(tiny_dirs[arch], dtype="float32", device="cpu")
    spec = {"method": method, "num_speculative_tokens": 5, "adaptive": False}
    if method == "draft_model":
        spec["model"] = tiny_dirs["draft"]
    fast = plain.with_speculation(spec, check_state=True)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafted = 0
    for prompt in PROMPTS:
        a = plain.generate({"prompt_token_ids": prompt}, params)[0]
        b = fast.generate({"prompt_token_ids": prompt}, params)[0]
        div = compare_greedy(plain.model, prompt, a.token_ids, b.token_ids)
        assert div is None or div.near_tie, f"{method} on {arch}, prompt {prompt}: {div}"
        drafted += b.stats["num_draft_tokens"]
    assert drafted > 0, "the drafter never proposed anything: the test would prove nothing"


def test_incompatible_draft_vocabulary_is_refused(tiny_dirs, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=4,
                                                 num_key_value_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary"):
        LLM(tiny_dirs["llama"], speculative_config={"method": "draft_model", "model": str(tmp_path)})


def test_too_long_request_frees_the_draft_slot(tiny_dirs):
    llm = LLM(tiny_dirs["llama"], dtype="float32", max_model_len=32,
              speculative_config={"method": "draft_model", "model": tiny_dirs["draft"]})
    for _ in range(2):  # the second call would find the draft cache's only slot taken if the first leaked it
        with pytest.raises(ValueError, match="exceeds the context"):
            llm.generate({"prompt_token_ids": [1] * 30}, SamplingParams(max_tokens=8))
    assert llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
