"""The real default model (SmolLM2-135M-Instruct, GGUF Q4_1, dequantised) against HF transformers."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.models.llama import Segment

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a JSON array with three users, each with id, name and email.",
    "def fibonacci(n):",
    "List the planets of the solar system as a Markdown table with their order.",
    "What is speculative decoding?",
]


@pytest.fixture(scope="module")
def llm():
    return LLM(dtype="float32", progress=False)


@pytest.fixture(scope="module")
def hf_from_gguf(llm):
    """HF's own GGUF loader: an independent path from the file to the weights."""
    from transformers import AutoModelForCausalLM

    gguf = llm.resolved.gguf
    assert gguf is not None
    return AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()


def test_logits_match_hf_gguf_loader(llm, hf_from_gguf):
    ids = llm.tokenizer(PROMPTS[0] + " " + PROMPTS[2])["input_ids"]
    x = torch.tensor(ids)
    with torch.no_grad():
        ref = hf_from_gguf(x[None]).logits[0]
    cache = llm.model.new_cache(128)
    slot = cache.allocate()
    out = llm.model(x, [Segment(slot, 0, len(ids))], cache, logits_indices=range(len(ids)))
    assert (out.logits - ref).abs().max().item() <= 1e-4


def test_greedy_equals_hf_generate(llm, hf_from_gguf):
    params = SamplingParams(temperature=0, max_tokens=32)
    for prompt in PROMPTS:
        text = llm.apply_chat_template([{"role": "user", "content": prompt}])
        ids = llm.tokenizer(text, add_special_tokens=False)["input_ids"]
        ours = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0]
        with torch.no_grad():
            ref = hf_from_gguf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                        eos_token_id=sorted(llm.eos_ids), pad_token_id=2)[0, len(ids):].tolist()
        assert ours.token_ids == ref, f"prompt {prompt!r}: ours {ours.token_ids} vs HF {ref}"
        assert ours.text.strip()


def test_chat_and_seeded_sampling(llm):
    msgs = [{"role": "user", "content": "Name a colour."}]
    p = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, max_tokens=12, seed=7)
    a = llm.chat(msgs, p)[0]
    b = llm.chat(msgs, p)[0]
    assert a.token_ids == b.token_ids and a.text == b.text
    assert a.stats["ttft_s"] > 0 and a.stats["output_tokens"] == len(a.token_ids)
