"""Tiny random models of each architecture the real-shape benchmarks use, written to GGUF with gguf's writer in
llama.cpp's layout (bench/synth_gguf.py), loaded through verispec's GGUF path, against HF transformers' logits on
the original weights: Qwen2's q/k/v biases, Qwen3's q/k RMSNorm and wide heads, Llama-3's `llama3` RoPE scaling
(stored as llama.cpp's `rope_freqs` tensor), an untied output head, GQA ratios 4 to 8. No llama.cpp needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from verispec.bench.synth_gguf import SHAPES, llama3_freq_factors, write_gguf
from verispec.models.gguf_config import llama3_from_factors
from verispec.models.llama import Segment
from verispec.models.loader import load_model

transformers = pytest.importorskip("transformers")

VOCAB = 101
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=4096)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 2048}


def _configs():
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    return {
        # GQA 4:1, q/k/v biases, untied head
        "qwen2-gqa4-untied": Qwen2Config(**BASE, num_attention_heads=8, num_key_value_heads=2,
                                         tie_word_embeddings=False, rope_theta=1e6),
        # GQA 8:1, per-head q/k norms, heads wider than hidden / heads, tied head
        "qwen3-gqa8": Qwen3Config(**BASE, num_attention_heads=8, num_key_value_heads=1, head_dim=16,
                                  tie_word_embeddings=True),
        # head_dim = hidden / heads, as in Qwen3-0.6B's shapes: the converted config must still name it (Qwen3's
        # config class defaults to 128)
        "qwen3-plain": Qwen3Config(**BASE, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        # llama3 RoPE scaling (three blended frequencies at head_dim 32, theta 1e4), GQA 4:1, untied head
        "llama3-gqa4-untied": LlamaConfig(**{**BASE, "hidden_size": 128}, num_attention_heads=4,
                                          num_key_value_heads=1, rope_theta=10000.0, rope_scaling=dict(LLAMA3),
                                          tie_word_embeddings=False),
    }


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """name -> (the GGUF written from an HF model's weights, the HF model)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for name, cfg in _configs().items():
        torch.manual_seed(sum(map(ord, name)))
        cfg._attn_implementation = "eager"
        hf = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():  # norms and biases away from their init, so that a dropped one shows
            for pname, p in hf.named_parameters():
                if "norm" in pname or "bias" in pname:
                    p.add_(torch.randn_like(p) * 0.2)
        d = cfg.to_dict()
        d["model_type"] = cfg.model_type
        path = write_gguf(tmp_path_factory.mktemp(name) / f"{name}.gguf", d, hf.state_dict(), float_type="f32")
        out[name] = (path, hf)
    return out


@pytest.mark.parametrize("name", list(_configs()))
def test_gguf_logits_match_hf(written, name):
    path, hf = written[name]
    ours, _ = load_model(str(path), dtype="float32", progress=False)
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    cache = ours.new_cache(64)
    slot = cache.allocate()
    got, start = [], 0
    for n in (17, 1, 4, 2):  # a prefill, then blocks as decode and verification run them
        got.append(ours(ids[start:start + n], [Segment(slot, start, n)], cache, logits_indices=range(n)).logits)
        cache.commit(slot, n)
        start += n
    err = (torch.cat(got) - ref).abs().max().item()
    assert err <= 1e-4, err


def test_loaded_config_says_what_hf_says(written):
    """The converted config keeps what speed and correctness depend on: tied or not, head_dim, the RoPE scaling."""
    from verispec.config import ModelConfig
    from verispec.models.loader import read_config, resolve

    for name, (path, hf) in written.items():
        cfg = ModelConfig.from_hf(read_config(resolve(str(path), progress=False).directory))
        assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings, name
        want = getattr(hf.config, "head_dim", None) or hf.config.hidden_size // hf.config.num_attention_heads
        assert cfg.head_dim == want, name
        assert cfg.num_kv_heads == hf.config.num_key_value_heads, name
    llama = ModelConfig.from_hf(read_config(resolve(str(written["llama3-gqa4-untied"][0]), progress=False).directory))
    assert (llama.rope_type, llama.rope_factor, llama.rope_low_freq_factor) == ("llama3", 8.0, 1.0)


@pytest.mark.parametrize("shape", ["llama-3.2-1b"])
def test_llama3_parameters_recovered_from_rope_freqs(shape):
    """The real Llama-3.2-1B scaling (factor 32, theta 5e5, head_dim 64) survives llama.cpp's divisor tensor."""
    cfg = SHAPES[shape]
    got = llama3_from_factors(llama3_freq_factors(cfg), cfg["rope_theta"], cfg["head_dim"])
    assert got == cfg["rope_scaling"]


def test_rope_freqs_not_llama3_is_refused():
    cfg = SHAPES["llama-3.2-1b"]
    f = llama3_freq_factors(cfg).copy()
    blended = np.flatnonzero((f > 1) & (f < 32))
    f[blended[0]] *= 1.3
    with pytest.raises(ValueError, match="not a llama3"):
        llama3_from_factors(f, cfg["rope_theta"], cfg["head_dim"])


def test_q8_0_file_runs_gguf_dequantised_weights(tmp_path):
    """synth_gguf's Q8_0 writing (gguf's quantizer, where llama-quantize is missing) loads as the weights gguf's own
    dequantisation gives: HF transformers on those weights is the reference."""
    import gguf
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=False)
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    d = cfg.to_dict()
    d["model_type"] = "qwen2"
    path = write_gguf(tmp_path / "q8.gguf", d, hf.state_dict(), float_type="q8_0")
    q8 = gguf.GGMLQuantizationType.Q8_0
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                rounded = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)
                p.copy_(torch.from_numpy(rounded.reshape(p.shape)))
    ours, _ = load_model(str(path), dtype="float32", progress=False)
    ids = torch.arange(12) * 5 % 64
    cache = ours.new_cache(16)
    slot = cache.allocate()
    got = ours(ids, [Segment(slot, 0, 12)], cache, logits_indices=range(12)).logits
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    assert (got - ref).abs().max().item() <= 1e-4
