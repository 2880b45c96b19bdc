"""DFlash / DSpark exports, read back by the names vLLM and SGLang load (speculators and z-lab's DFlash layouts)
and run through a plain-torch re-implementation written here from those layouts' conventions (HF-style RoPE,
features taken from HF's hidden_states by each layout's layer-id rule): the same draft logits, Markov-corrected
logits and confidence logits as our drafter."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from verispec.drafters.dflash_export import export
from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts
from verispec.models.loader import load_model

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rope_theta=5000.0, eos_token_id=7)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(2)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**COMMON)).eval()
    d = tmp_path_factory.mktemp("target")
    hf.save_pretrained(d)
    model, _ = load_model(str(d), dtype="float32", device="cpu")
    return hf, model


def drafter(model, dspark: bool) -> DFlashModel:
    torch.manual_seed(4)
    cfg = DFlashConfig.for_target(model.cfg, num_layers=2, block_size=5, dspark=dspark, markov_rank=6)
    m = DFlashModel(cfg, TargetParts.of(model, dtype=torch.float32))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)  # every weight matters, norms and the Markov head included
    return m.eval()


def rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x, pos, theta):
    """HF's rotate-half RoPE: x [n, heads, hd] at positions pos [n]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = pos.float()[:, None] * inv[None]  # [n, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def reference_block(w: dict, conf: dict, feats, block_emb, p: int):
    """The layout's DFlash forward. feats: [C, m d] context features at positions 0..C-1; block_emb: [B, d] at
    positions p..p+B-1 -> final-normed block states [B, d]."""
    eps, theta = conf["rms_norm_eps"], conf["rope_theta"]
    H, K, hd = conf["num_attention_heads"], conf["num_key_value_heads"], conf["head_dim"]
    C, B = feats.shape[0], block_emb.shape[0]
    ctx = rms(feats @ w["fc.weight"].t(), w["hidden_norm.weight"], eps)  # [C, d]
    pos_ctx, pos_blk = torch.arange(C), torch.arange(p, p + B)
    x = block_emb
    for i in range(conf["num_hidden_layers"]):
        g = lambda n: w[f"layers.{i}.{n}"]  # noqa: E731
        h = rms(x, g("input_layernorm.weight"), eps)
        q = rope(rms((h @ g("self_attn.q_proj.weight").t()).view(B, H, hd), g("self_attn.q_norm.weight"), eps),
                 pos_blk, theta)
        kin = torch.cat([ctx, h])  # context rows skip input_layernorm
        k = rms((kin @ g("self_attn.k_proj.weight").t()).view(C + B, K, hd), g("self_attn.k_norm.weight"), eps)
        k = rope(k, torch.cat([pos_ctx, pos_blk]), theta)
        v = (kin @ g("self_attn.v_proj.weight").t()).view(C + B, K, hd)
        k, v = k.repeat_interleave(H // K, 1), v.repeat_interleave(H // K, 1)
        att = torch.softmax(torch.einsum("bhd,nhd->hbn", q, k) / math.sqrt(hd), -1)  # no mask: bidirectional
        x = x + torch.einsum("hbn,nhd->bhd", att, v).reshape(B, H * hd) @ g("self_attn.o_proj.weight").t()
        m = rms(x, g("post_attention_layernorm.weight"), eps)
        x = x + (F.silu(m @ g("mlp.gate_proj.weight").t()) * (m @ g("mlp.up_proj.weight").t())) @ g(
            "mlp.down_proj.weight").t()
    return rms(x, w["norm.weight"], eps)


def ours(m: DFlashModel, model, ids: list[int], prev: torch.Tensor):
    """Our drafter on context ids[:-1], anchor ids[-1]: (logits [B-1, V], corrected, confidence logits)."""
    from verispec.execution.features import target_features

    feats, _ = target_features(model, ids, m.cfg.feature_layers)
    p = len(ids) - 1
    with torch.no_grad():
        h = m.forward_train(feats[:p], torch.arange(p), torch.zeros(p, dtype=torch.long), torch.tensor([ids[-1]]),
                            torch.tensor([p]), torch.tensor([0]))[0, 1:]  # [B-1, d]
        z = m.logits(h)
        if m.markov is None:
            return z, None, None
        return z, z + m.markov.bias(prev).float(), m.markov.conf_logits(h, prev).float()


IDS = [3, 17, 22, 9, 41, 5, 8, 30]


@pytest.mark.parametrize("dspark", [False, True])
def test_speculators_export_reads_back_to_the_same_logits(target, tmp_path, dspark):
    hf, model = target
    m = drafter(model, dspark)
    out = export(m, model, tmp_path / "x", "speculators", mask_token_id=11, verifier="tiny", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    layer = conf["transformer_layer_config"]
    assert conf["speculators_model_type"] == ("dspark" if dspark else "dflash") and not conf["sample_from_anchor"]
    assert conf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert conf["speculators_config"]["verifier"] == {"name_or_path": "tiny", "architectures": ["LlamaForCausalLM"]}
    with torch.no_grad():
        hs = hf(torch.tensor([IDS]), output_hidden_states=True).hidden_states  # speculators: hidden_states[id]
    feats = torch.cat([hs[i][0] for i in conf["aux_hidden_state_layer_ids"]], -1)
    p, B = len(IDS) - 1, conf["block_size"]
    emb = w["embed_tokens.weight"][torch.tensor([IDS[-1]] + [conf["mask_token_id"]] * (B - 1))]
    h = reference_block(w, layer, feats[:p], emb, p)[1:]
    z_ref = h @ w["lm_head.weight"].t()
    prev = torch.tensor([IDS[-1], 4, 50, 2])  # the anchor, then the tokens drafted at slots 1..3
    z, zc, c = ours(m, model, IDS, prev)
    torch.testing.assert_close(z, z_ref, atol=2e-4, rtol=1e-4)
    if dspark:
        e1 = w["markov_head.markov_w1.weight"][prev]
        torch.testing.assert_close(zc, z_ref + e1 @ w["markov_head.markov_w2.weight"].t(), atol=2e-4, rtol=1e-4)
        c_ref = torch.cat([h, e1], -1) @ w["confidence_head.proj.weight"].t() + w["confidence_head.proj.bias"]
        torch.testing.assert_close(c, c_ref.squeeze(-1), atol=2e-4, rtol=1e-4)
        assert conf["markov_rank"] == 6 and conf["enable_confidence_head"] and conf["confidence_head_with_markov"]


def test_dflash_layout_reads_back_to_the_same_logits(target, tmp_path):
    hf, model = target
    m = drafter(model, False)
    out = export(m, model, tmp_path / "x", "dflash", dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    w = load_file(str(out / "model.safetensors"))
    assert conf["architectures"] == ["DFlashDraftModel"] and conf["num_target_layers"] == 6
    assert conf["dflash_config"]["mask_token_id"] == 7  # the target's EOS by default
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in w)  # shared with the target
    with torch.no_grad():
        hs = hf(torch.tensor([IDS]), output_hidden_states=True).hidden_states  # z-lab: hidden_states[id + 1]
    feats = torch.cat([hs[i + 1][0] for i in conf["dflash_config"]["target_layer_ids"]], -1)
    p, B = len(IDS) - 1, conf["block_size"]
    mask_file = torch.load(out / "mask_embedding.pt", weights_only=True)  # llama.cpp's layout (test_exports.py)
    assert mask_file["mask_token_id"] == conf["dflash_config"]["mask_token_id"]
    mask = mask_file["embedding"]
    emb = torch.cat([hf.model.embed_tokens.weight[IDS[-1]][None], mask.expand(B - 1, -1)]).detach()
    z_ref = reference_block(w, conf, feats[:p], emb, p)[1:] @ hf.lm_head.weight.detach().t()
    z, _, _ = ours(m, model, IDS, torch.tensor([0]))
    torch.testing.assert_close(z, z_ref, atol=2e-4, rtol=1e-4)


def test_bad_exports_are_refused(target, tmp_path):
    _, model = target
    with pytest.raises(ValueError, match="only in the speculators layout"):
        export(drafter(model, True), model, tmp_path / "a", "dflash")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        export(drafter(model, False), model, tmp_path / "b", "speculators", mask_token_id=64)
    with pytest.raises(ValueError, match="unknown export format"):
        export(drafter(model, False), model, tmp_path / "c", "eagle")
