"""Our decoder's logits against HF transformers on the same weights (tiny random configs, fp32)."""

from __future__ import annotations

import pytest
import torch

from verispec.models.llama import Segment
from verispec.models.loader import load_model

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)


def _configs():
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    return {
        "llama": LlamaConfig(**COMMON, tie_word_embeddings=False, rope_theta=5000.0),
        "llama-tied": LlamaConfig(**COMMON, tie_word_embeddings=True),
        "llama-bias": LlamaConfig(**COMMON, attention_bias=True, mlp_bias=True),
        "llama3-rope": LlamaConfig(**COMMON, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                           "high_freq_factor": 4.0,
                                                           "original_max_position_embeddings": 32}),
        "linear-rope": LlamaConfig(**COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "qwen2": Qwen2Config(**COMMON),
        "qwen2-window": Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=5, max_window_layers=1),
        "qwen3": Qwen3Config(**COMMON, head_dim=24),
        "mistral-window": MistralConfig(**COMMON, sliding_window=6),
    }


CONFIG_NAMES = list(_configs())


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(hash(name) % 1000)
        cfg._attn_implementation = "eager"
        hf = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # random norms and biases, so that the test sees them
            for pname, p in hf.named_parameters():
                if "norm" in pname or "bias" in pname:
                    p.add_(torch.randn_like(p) * 0.1)
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        out[name] = (d, hf)
    return out


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_logits_match_hf(saved_models, name):
    directory, hf = saved_models[name]
    ours, _ = load_model(str(directory), dtype="float32")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 97, (20,), generator=g)
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]  # [20, V]
    cache = ours.new_cache(64)
    slot = cache.allocate()
    # prefill 13 tokens, then blocks of 1, 4 and 2: every position's logits must match the full forward
    got = []
    start = 0
    for n in (13, 1, 4, 2):
        out = ours(ids[start : start + n], [Segment(slot, start, n)], cache, logits_indices=range(n))
        cache.commit(slot, n)
        got.append(out.logits)
        start += n
    got = torch.cat(got)
    assert (got - ref).abs().max().item() <= 1e-4, (got - ref).abs().max().item()


@pytest.mark.parametrize("name", ["llama", "mistral-window", "qwen3"])
def test_batched_segments_match_single(saved_models, name):
    """Two sequences in one flat forward give the same logits as each alone (ragged blocks)."""
    directory, hf = saved_models[name]
    ours, _ = load_model(str(directory), dtype="float32")
    a = torch.randint(0, 97, (11,))
    b = torch.randint(0, 97, (7,))
    with torch.no_grad():
        ref_a = hf(a[None]).logits[0]
        ref_b = hf(b[None]).logits[0]
    cache = ours.new_cache(32, num_slots=2)
    sa, sb = cache.allocate(), cache.allocate()
    ours(a[:8], [Segment(sa, 0, 8)], cache)
    cache.commit(sa, 8)
    out = ours(torch.cat([a[8:], b]), [Segment(sa, 8, 3), Segment(sb, 0, 7)], cache, logits_indices=range(10))
    assert (out.logits[:3] - ref_a[8:]).abs().max() <= 1e-4
    assert (out.logits[3:] - ref_b).abs().max() <= 1e-4


def test_hidden_states_entering_layers(saved_models):
    directory, hf = saved_models["llama"]
    ours, _ = load_model(str(directory), dtype="float32")
    ids = torch.randint(0, 97, (9,))
    with torch.no_grad():
        ref = hf(ids[None], output_hidden_states=True).hidden_states  # [0] = embeddings = entering layer 0
    cache = ours.new_cache(16)
    slot = cache.allocate()
    out = ours(ids, [Segment(slot, 0, 9)], cache, capture_layers=(0, 1, 2))
    for layer in (0, 1, 2):
        assert (out.hidden[layer] - ref[layer][0]).abs().max() <= 1e-5
