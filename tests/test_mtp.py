"""Native MTP heads (`--method mtp`) on tiny synthetic targets saved in the DeepSeek-V3, MiMo and Qwen3-Next layouts.

The reference is written here from vLLM's public model code (deepseek_mtp.py, mimo_mtp.py, qwen3_next_mtp.py), with
the layouts' tensor names spelled out independently of verispec's table: HF transformers' own decoder layers run
the block (Qwen3-Next's zero-centred norms are HF's `Qwen3NextRMSNorm` modules swapped in), the whole sequence is
recomputed from scratch for every draft step, and the target's states come from HF's forward (post-norm from
`hidden_states`, pre-norm from a hook on the last layer). Then: the engine with the MTP drafter equals HF's greedy
output with the state oracle on, a corrupted MTP K/V row is caught, and broken layouts are refused by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tests.helpers import hf_greedy
from verispec import LLM, SamplingParams
from verispec.drafters.mtp import MTPDrafter, load
from verispec.models.loader import load_model
from verispec.models.mtp_layout import MTPLayoutError, detect, problems

V, D, L = 64, 32, 2
LAYOUTS = ("deepseek_v3", "mimo", "qwen3_next")


def _names(layout: str) -> dict[str, str]:
    """The layouts' tensor names, from vLLM's loaders (layer 0 of a 2-layer target)."""
    if layout == "deepseek_v3":
        p = f"model.layers.{L}."
        return {"emb_norm": p + "enorm.weight", "hidden_norm": p + "hnorm.weight", "proj": p + "eh_proj.weight",
                "out_norm": p + "shared_head.norm.weight", "head": p + "shared_head.head.weight",
                "embed": p + "embed_tokens.weight", "block": p}
    if layout == "mimo":
        p = "model.mtp_layers.0."
        return {"emb_norm": p + "token_layernorm.weight", "hidden_norm": p + "hidden_layernorm.weight",
                "proj": p + "input_proj.weight", "out_norm": p + "final_layernorm.weight", "block": p}
    return {"emb_norm": "mtp.pre_fc_norm_embedding.weight", "hidden_norm": "mtp.pre_fc_norm_hidden.weight",
            "proj": "mtp.fc.weight", "out_norm": "mtp.norm.weight", "block": "mtp.layers.0."}


def _hf_classes(layout: str):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    return {"deepseek_v3": (LlamaConfig, LlamaForCausalLM, LlamaDecoderLayer),
            "mimo": (Qwen2Config, Qwen2ForCausalLM, Qwen2DecoderLayer),
            "qwen3_next": (Qwen3Config, Qwen3ForCausalLM, Qwen3DecoderLayer)}[layout]


def _zero_centred(block, d: int, hd: int, eps: float) -> None:
    """Swap HF's Qwen3-Next RMSNorm (scale 1 + w) into an HF Qwen3 decoder layer, weights kept."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    for owner, attr, size in ((block, "input_layernorm", d), (block, "post_attention_layernorm", d),
                              (block.self_attn, "q_norm", hd), (block.self_attn, "k_norm", hd)):
        new = Qwen3NextRMSNorm(size, eps=eps)
        new.weight.data.copy_(getattr(owner, attr).weight.data)
        setattr(owner, attr, new)


def make_target(root, layout: str, seed: int = 0, n_mtp: int = 1, extra: dict | None = None,
                drop: tuple[str, ...] = ()):
    """A tiny target with MTP layers in `layout`, saved to root; returns (HF target, the reference MTP parts)."""
    cfg_cls, model_cls, layer_cls = _hf_classes(layout)
    torch.manual_seed(seed)
    cfg = cfg_cls(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, head_dim=8)
    cfg._attn_implementation = "eager"
    hf = model_cls(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(3.0)
        hf.model.norm.weight.copy_(1.0 + 0.3 * torch.randn(D))  # so the states before and after it differ in shape
    hf.save_pretrained(root)
    zc = layout == "qwen3_next"
    block = layer_cls(cfg, layer_idx=0).eval()  # its index only picks the (full) attention type
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:  # not all ones, so a norm left out or applied twice shows
                p.copy_((0.0 if zc else 1.0) + 0.2 * torch.randn_like(p))
    n = _names(layout)
    parts = {k: (0.0 if zc else 1.0) + 0.2 * torch.randn(D) for k in ("emb_norm", "hidden_norm", "out_norm")}
    parts["proj"] = torch.randn(D, 2 * D) / (2 * D) ** 0.5
    if "head" in n:
        parts["head"], parts["embed"] = 3 * torch.randn(V, D) / D**0.5, torch.randn(V, D)
    sd = load_file(str(root / "model.safetensors"))
    for i in range(n_mtp):
        for role, t in parts.items():
            name = n[role].replace(f"layers.{L}.", f"layers.{L + i}.").replace("mtp_layers.0.", f"mtp_layers.{i}.")
            if i == 0 or layout != "qwen3_next":
                sd[name] = t.clone()
        prefix = n["block"].replace(f"layers.{L}.", f"layers.{L + i}.").replace(".0.", f".{i}.")
        for name, p in block.state_dict().items():
            sd[prefix + name] = p.clone()
    sd.update(extra or {})
    for name in drop:
        sd.pop(name)
    save_file(sd, str(root / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((root / "config.json").read_text())
    raw["num_nextn_predict_layers"] = n_mtp
    if layout == "mimo":
        raw.update(model_type="mimo", architectures=["MiMoForCausalLM"])
    (root / "config.json").write_text(json.dumps(raw))
    if zc:
        _zero_centred(block, D, cfg.head_dim, cfg.rms_norm_eps)
    return hf, {**parts, "block": block, "layout": layout}


def _rms(x, w, eps, zero_centred):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    norm = (Qwen3NextRMSNorm if zero_centred else LlamaRMSNorm)(x.shape[-1], eps=eps)
    norm.weight.data.copy_(w)
    return norm(x)


def reference_steps(hf, ref, tokens: list[int], drafts: list[int]) -> list[torch.Tensor]:
    """The MTP's logits for each draft step after `tokens` (committed + pending), teacher-forced on `drafts`,
    every step recomputed over the whole sequence with HF's layer (causal, full attention)."""
    layout, eps = ref["layout"], hf.config.rms_norm_eps
    zc = layout == "qwen3_next"
    ids = torch.tensor([tokens])
    captured = {}
    hook = hf.model.layers[-1].register_forward_hook(lambda m, a, out: captured.update(pre=out[0] if isinstance(
        out, tuple) else out))
    with torch.no_grad():
        out = hf(ids, output_hidden_states=True)
    hook.remove()
    h = (captured["pre"] if layout == "mimo" else out.hidden_states[-1])[0, :-1]  # [n, d], n = len(tokens) - 1
    emb_table = ref["embed"] if "embed" in ref else hf.model.embed_tokens.weight
    head = ref["head"] if "head" in ref else hf.lm_head.weight
    rows_h, rows_tok = list(h), tokens[1:]
    logits_out = []
    for s in range(len(drafts) + 1):
        n = len(rows_tok)
        e = emb_table[torch.tensor(rows_tok)].clone()
        if layout != "qwen3_next":
            e[0] = 0.0  # vLLM masks the embedding at position 0 for DeepSeek and MiMo
        hh = torch.stack(rows_h)
        e_n, h_n = _rms(e, ref["emb_norm"], eps, zc), _rms(hh, ref["hidden_norm"], eps, zc)
        x = F.linear(torch.cat([h_n, e_n] if layout == "mimo" else [e_n, h_n], -1), ref["proj"])[None]
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            o = ref["block"](x, attention_mask=mask, position_ids=pos,
                             position_embeddings=hf.model.rotary_emb(x, pos))
        o = (o[0] if isinstance(o, tuple) else o)[0]  # [n, d]
        normed = _rms(o, ref["out_norm"], eps, zc)
        state = o if layout == "deepseek_v3" else normed
        logits_out.append(F.linear(normed[-1], head).float())
        if s < len(drafts):
            rows_h.append(state[-1])
            rows_tok.append(drafts[s])
    return logits_out[: len(drafts)] if drafts else logits_out


@pytest.fixture(scope="module", params=LAYOUTS)
def target(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"mtp-{request.param}")
    hf, ref = make_target(root, request.param)
    model, _ = load_model(str(root), dtype="float32", device="cpu")
    return {"root": root, "hf": hf, "ref": ref, "model": model, "head": load(root, model)}


def _drafter(t, params: SamplingParams) -> MTPDrafter:
    head = t["head"]
    return MTPDrafter(head, head.new_cache(128, 2), params)


def _feed(d: MTPDrafter, model, tokens: list[int], start: int) -> None:
    """Hand the drafter the target's last-layer outputs of tokens[start:-1] (the committed positions it lacks)."""
    from verispec.execution.features import target_features

    feats, _ = target_features(model, tokens[:-1], d.feature_layers)
    d.add_features(feats[start:])


def test_target_with_mtp_tensors_loads_and_matches_hf(target):
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = target["hf"](ids).logits[0, -1]
    _, _, out = target["model"].prefill_fresh(ids[0].tolist())
    assert torch.allclose(out.logits[0], want, atol=1e-4), "the MTP tensors must not disturb the target's weights"


def test_sampled_drafts_follow_the_reference_distributions(target):
    """T = 1, seeded: every draft step's q equals the reference's softmax teacher-forced on the sampled drafts;
    then 3 more tokens are committed (as after an acceptance) and the next proposal is checked again."""
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, V, (9,), generator=g).tolist()
    d = _drafter(target, SamplingParams(temperature=1.0, seed=7))
    _feed(d, target["model"], tokens, 0)
    for round_ in range(2):
        draft = d.propose(tokens, 4)
        assert len(draft.tokens) == 4 and draft.probs is not None
        want = reference_steps(target["hf"], target["ref"], tokens, draft.tokens)
        for s, (q, logits) in enumerate(zip(draft.probs, want)):
            assert torch.allclose(q, torch.softmax(logits, -1), atol=2e-5), f"round {round_}, draft step {s}"
        n_before = len(tokens)
        tokens = tokens + draft.tokens[:2] + [int(torch.randint(0, V, (1,), generator=g))]
        d.observe(2)
        _feed(d, target["model"], tokens, n_before - 1)


def test_greedy_drafts_equal_the_reference_argmax(target):
    tokens = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    d = _drafter(target, SamplingParams(temperature=0))
    _feed(d, target["model"], tokens, 0)
    draft = d.propose(tokens, 3)
    want = reference_steps(target["hf"], target["ref"], tokens, draft.tokens)
    assert draft.tokens == [int(w.argmax()) for w in want]


def test_confidences_are_the_reference_probabilities_and_min_survival_cuts_the_chain(target):
    """Greedy: each position's confidence is the reference's softmax top-1 (teacher-forced on the drafts); with
    min_survival s the chain stops after the first token whose running product falls below s (same tokens), and
    the MTP cache is back at the committed rows (the state oracle, after one draft accepted)."""
    from verispec.execution.features import target_features

    tokens = torch.randint(0, V, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    d = _drafter(target, SamplingParams(temperature=0))
    _feed(d, target["model"], tokens, 0)
    full = d.propose(tokens, 4)
    want = reference_steps(target["hf"], target["ref"], tokens, full.tokens)
    for c, logits in zip(full.confidence, want):
        assert c == pytest.approx(float(torch.softmax(logits.detach().float(), -1).max()), abs=2e-5)
    surv = torch.tensor(full.confidence).cumprod(0).tolist()
    s = (surv[0] + surv[1]) / 2
    d = _drafter(target, SamplingParams(temperature=0))
    _feed(d, target["model"], tokens, 0)
    assert d.propose(tokens, 4, min_survival=s).tokens == full.tokens[:2]
    d.observe(1)
    committed = tokens + [full.tokens[0]]
    _feed(d, target["model"], committed + [full.tokens[1]], len(tokens) - 1)
    ref, _ = target_features(target["model"], committed, d.feature_layers)
    d.check_state(ref, committed)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_engine_output_equals_hf_with_state_oracle(target, temperature):
    """Greedy: the engine's output equals HF's. T = 1: every step passes the state oracle (target K/V and the MTP's
    own K/V recomputed from scratch) while several drafts per step are accepted."""
    llm = LLM(str(target["root"]), dtype="float32", max_model_len=128, max_num_seqs=3, progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
              check_state=True, max_num_batched_tokens=8, scheduler="static")
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, V, (6 + i,), generator=g).tolist() for i in range(4)]
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=20, ignore_eos=True) for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert all(o.stats["drafter_error"] is None and o.stats["num_draft_tokens"] > 0 for o in outs)
    if temperature == 0:
        for p, o in zip(prompts, outs):
            assert o.token_ids == hf_greedy(target["hf"], p, 20)
    else:  # a second draft accepted in some step: multi-token commits happened under the oracle
        assert any(len(pa) > 1 and pa[1] > 0 for pa in (o.stats["per_position_acceptance"] for o in outs))
    assert llm.engine.kv_tokens() == 0


def test_seeded_sampling_equals_plain_decoding_alone_and_batched(target):
    """Seeded requests (T = 1) speculating with the MTP head give exactly the tokens seeded plain decoding gives
    (sampling/coupled.py), in a batch of 8 and alone, while drafts are accepted and rejected."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (5 + i % 3,), generator=g).tolist() for i in range(8)]
    params = [SamplingParams(temperature=1.0, seed=100 + i, max_tokens=16, ignore_eos=True) for i in range(8)]
    plain = LLM(str(target["root"]), dtype="float32", max_model_len=128, max_num_seqs=1, progress=False)
    want = [o.token_ids for o in plain.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = LLM(str(target["root"]), dtype="float32", max_model_len=128, max_num_seqs=8, progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
              scheduler="static")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    accepted = sum(o.stats["num_accepted_tokens"] for o in outs)
    assert 0 < accepted < sum(o.stats["num_draft_tokens"] for o in outs)
    assert [o.token_ids for o in outs] == want
    alone = llm.generate({"prompt_token_ids": prompts[2]}, params[2], use_tqdm=False)[0].token_ids
    assert alone == want[2]


def test_state_oracle_catches_a_corrupted_mtp_row(target):
    """As in the engine: propose, no draft accepted, the pending token committed with its target state; the oracle
    passes, then fails naming a corrupted committed K row."""
    from verispec.execution.features import target_features

    tokens = torch.randint(0, V, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    d = _drafter(target, SamplingParams(temperature=0))
    _feed(d, target["model"], tokens[:8], 0)
    d.propose(tokens[:8], 2)
    d.observe(0)
    _feed(d, target["model"], tokens, 7)
    committed = tokens[:8]
    ref, _ = target_features(target["model"], committed, d.feature_layers)
    d.check_state(ref, committed)
    d.cache.k[0][d.slot, :, 3] += 0.5
    with pytest.raises(AssertionError, match="K of position 3"):
        d.check_state(ref, committed)


# ---- refusals ------------------------------------------------------------------------------------------------
def test_a_target_without_mtp_layers_is_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=D, intermediate_size=64, num_hidden_layers=L,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    with pytest.raises(MTPLayoutError, match="ships no MTP layers"):
        LLM(str(tmp_path), dtype="float32", max_model_len=64, progress=False,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2})


@pytest.mark.parametrize("layout,extra,match", [
    ("deepseek_v3", {f"model.layers.{L}.self_attn.q_a_proj.weight": torch.zeros(8, D)}, "latent attention"),
    ("mimo", {"model.mtp_layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(8, D)}, "mixture-of-experts"),
    ("qwen3_next", {"mtp.layers.0.mlp.gate.weight": torch.zeros(4, D)}, "mixture-of-experts router"),
])
def test_foreign_blocks_are_refused_by_name(tmp_path, layout, extra, match):
    make_target(tmp_path, layout, extra=extra)
    model, _ = load_model(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(MTPLayoutError, match=match):
        load(tmp_path, model)


def test_gated_attention_is_refused(tmp_path):
    make_target(tmp_path, "qwen3_next", extra={"mtp.layers.0.self_attn.q_proj.weight": torch.zeros(2 * 32, D)})
    model, _ = load_model(str(tmp_path), dtype="float32", device="cpu")
    with pytest.raises(MTPLayoutError, match="gated attention"):
        load(tmp_path, model)


def test_missing_and_miscounted_layers_are_named(tmp_path):
    make_target(tmp_path, "mimo", drop=("model.mtp_layers.0.hidden_layernorm.weight",))
    cfg = json.loads((tmp_path / "config.json").read_text())
    names = set(load_file(str(tmp_path / "model.safetensors")))
    layout, count = detect(cfg, names)
    assert (layout.name, count) == ("mimo", 1)
    assert any("hidden_layernorm" in p for p in problems(layout, names, L, count))
    with pytest.raises(MTPLayoutError, match="declares num_nextn_predict_layers = 2"):
        detect({**cfg, "num_nextn_predict_layers": 2}, names)


def test_two_layer_checkpoints_count_and_load(tmp_path):
    make_target(tmp_path, "deepseek_v3", n_mtp=2)
    model, _ = load_model(str(tmp_path), dtype="float32", device="cpu")
    head = load(tmp_path, model)
    assert len(head.layers) == 2 and head.layout.name == "deepseek_v3"


def test_unused_tensors_still_refused_without_a_declared_mtp_layer(tmp_path):
    make_target(tmp_path, "deepseek_v3")
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["num_nextn_predict_layers"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="not used by the model"):
        load_model(str(tmp_path), dtype="float32", device="cpu")


# ---- the doctor ------------------------------------------------------------------------------------------------
def test_doctor_runs_the_mtp_chain_and_names_a_broken_layout(tmp_path):
    """A MiMo-layout target passes every link (identity on vs off, state oracle); one with a MoE block stops at
    the drafter link with that reason, the later links skipped."""
    from verispec.doctor.run import STAGES, DoctorOptions, run_doctor

    good, bad = tmp_path / "good", tmp_path / "bad"
    make_target(good, "mimo")
    make_target(bad, "mimo", extra={"model.mtp_layers.0.mlp.experts.0.gate_proj.weight": torch.zeros(8, D)})
    fast = {"max_tokens": 6, "state_steps": 6, "k": 2, "scheduler": "static"}
    report = run_doctor(DoctorOptions(str(good), "mtp", **fast))
    assert report.ok, [(c.name, c.reason) for c in report.checks if not c.ok]
    assert any("MTP layout mimo" in c.detail for c in report.checks)
    report = run_doctor(DoctorOptions(str(bad), "mtp", **fast))
    broken = next(c for c in report.checks if not c.ok)
    assert broken.name == "drafter architecture" and "mixture-of-experts" in broken.reason
    assert report.skipped == STAGES[2:]


def test_prefix_hits_hand_the_mtp_head_the_kept_hidden_states(target):
    """Prefix caching with an MTP head: a second turn whose prompt repeats the first turn's prompt and answer hits
    their blocks, and the head, given the kept last-layer states of the hit positions, passes the state oracle at
    every step (its own K/V recomputed from scratch); greedy output is HF's."""
    llm = LLM(str(target["root"]), dtype="float32", max_model_len=128, max_num_seqs=2, progress=False,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False},
              check_state=True, scheduler="static", enable_prefix_caching=True, block_size=4)
    g = torch.Generator().manual_seed(5)
    first = torch.randint(0, V, (13,), generator=g).tolist()
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a1 = llm.generate({"prompt_token_ids": first}, greedy, use_tqdm=False)[0].token_ids
    second = first + a1 + [1, 2, 3]
    a2 = llm.generate({"prompt_token_ids": second}, greedy, use_tqdm=False)[0]
    assert a1 == hf_greedy(target["hf"], first, 12)
    assert a2.token_ids == hf_greedy(target["hf"], second, 12)
    assert llm.cache.prefix_hits == (len(first) + len(a1) - 1) // 4 * 4
    assert a2.stats["num_draft_tokens"] > 0
