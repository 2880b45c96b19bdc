"""EAGLE-3 end to end on a tiny target: self-distillation data -> TTT training -> drafting in the engine.

References: HF transformers' greedy output (the engine with the head must equal it), a from-scratch recomputation
of the head's state (state oracle, with a negative control), a plain-torch re-implementation of the head from the
EXPORTED tensor names (so the vLLM/SGLang layout maps every weight to its role), and the drafter's own inference
loop for the training-time-test unroll (training must see what inference sees)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tests.helpers import assert_drawn_without_replacement, best_paths, eagle2_scores, hf_greedy
from verispec import LLM, SamplingParams
from verispec.drafters.eagle3 import Eagle3Config, Eagle3Drafter, Eagle3Head, load
from verispec.drafters.eagle3_export import export_from_checkpoint
from verispec.train import eagle3 as te
from verispec.train.data import generate_data
from verispec.train.shards import load_all

MAX_NEW = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        hf.lm_head.weight.mul_(4.0)  # sharp distributions: a learnable target
    root = tmp_path_factory.mktemp("eagle3")
    hf.save_pretrained(root / "target")
    llm = LLM(str(root / "target"), dtype="float32", max_model_len=128, max_num_seqs=4, progress=False)
    g = torch.Generator().manual_seed(1)
    prompts = [{"id": f"p{i}", "ids": torch.randint(1, 60, (8,), generator=g).tolist()} for i in range(24)]
    generate_data(llm, str(root / "data"), prompts, sources=["test"], modes=("greedy", "sampled"), max_tokens=40,
                  shard_size=16, progress=False)
    info = te.train(str(root / "data"), llm.model, str(root / "head"), draft_vocab=40, steps=3, max_updates=300,
                    lr=3e-3, batch=2, progress=False)
    return {"root": root, "hf": hf, "llm": llm, "prompts": prompts, "info": info}


def test_training_lowers_heldout_loss_and_raises_accuracy(setup):
    before, after = setup["info"]["heldout_before"], setup["info"]["heldout_after"]
    assert after["loss"] < before["loss"] - 0.1
    assert after["top1_per_step"][0] > before["top1_per_step"][0] + 0.05


def test_init_continues_from_a_trained_head(setup, tmp_path):
    """--init: the run starts where the given head ended (its held-out metrics before the first update are the
    trained head's after its last), keeps its draft vocabulary, and refuses a head of another shape."""
    root, llm = setup["root"], setup["llm"]
    info = te.train(str(root / "data"), llm.model, str(tmp_path / "more"), draft_vocab=40, steps=3, max_updates=2,
                    lr=1e-4, batch=2, progress=False, init=str(root / "head"), eval_every=1)
    want = setup["info"]["heldout_after"]
    assert abs(info["heldout_before"]["loss"] - want["loss"]) < 1e-4
    assert info["heldout_before"]["top1_per_step"] == want["top1_per_step"]
    assert torch.equal(load(tmp_path / "more", llm.model).d2t, load(root / "head", llm.model).d2t)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        te.train(str(root / "data"), llm.model, str(tmp_path / "other"), draft_vocab=30, steps=3, max_updates=1,
                 progress=False, init=str(root / "head"))


def test_soft_labels_are_the_targets_top_tokens_on_the_rows_the_loss_reads(setup):
    """From the last prompt position on, each row is the top TOPK of the full softmax of last_hidden @ W_out^T
    (computed here directly); the prompt rows before it carry no probability mass, so the loss cannot use them."""
    llm = setup["llm"]
    out_w = llm.model.output_weight().detach().float()
    seq = load_all(setup["root"] / "data")[0]
    lab = te.soft_labels(seq, out_w, max_len=30)
    T, start = min(len(seq.ids), 30), seq.prompt_len - 1
    assert lab.ids.shape == lab.probs.shape == (T, te.TOPK)
    full = torch.softmax(seq.last_hidden[:T].float() @ out_w.T, dim=-1)
    want_p, want_i = full.topk(te.TOPK, dim=-1)
    assert torch.equal(lab.ids[start:], want_i[start:])
    torch.testing.assert_close(lab.probs[start:], want_p[start:], rtol=1e-5, atol=1e-7)
    assert float(lab.probs[:start].abs().sum()) == 0.0


def test_soft_labels_cache_returns_what_was_computed_and_misses_on_any_change(setup, tmp_path, monkeypatch):
    """The second run reads the labels from the data directory (nothing recomputed: the projection is made to fail)
    and they equal a direct computation; another output matrix or changed states give another key; an unwritable
    directory only warns."""
    from dataclasses import astuple, replace

    from verispec.train.label_cache import CACHE_DIR, cached_labels

    out_w = setup["llm"].model.output_weight().detach().float()
    seqs = load_all(setup["root"] / "data")[:5]

    def compute(q):
        return astuple(te.soft_labels(q, out_w, 30))

    first, hit = cached_labels(seqs, out_w, te.TOPK, 30, tmp_path, compute)
    assert not hit and len(list((tmp_path / CACHE_DIR).glob("*.safetensors"))) == 1

    def boom(q):
        raise AssertionError("recomputed")

    again, hit = cached_labels(seqs, out_w, te.TOPK, 30, tmp_path, boom)
    assert hit and len(again) == len(seqs)
    for q, (ids, probs) in zip(seqs, again):
        want = te.soft_labels(q, out_w, 30)
        assert torch.equal(ids, want.ids) and torch.equal(probs, want.probs)
    for changed in ([replace(seqs[0], last_hidden=seqs[0].last_hidden * 1.5)] + seqs[1:], seqs[:4]):
        assert not cached_labels(changed, out_w, te.TOPK, 30, tmp_path, compute)[1]
    assert not cached_labels(seqs, out_w * 1.01, te.TOPK, 30, tmp_path, compute)[1]
    assert not cached_labels(seqs, out_w, te.TOPK, 20, tmp_path, lambda q: astuple(te.soft_labels(q, out_w, 20)))[1]
    ro = tmp_path / "ro"
    ro.write_text("a file where the cache directory would go")
    with pytest.warns(UserWarning, match="not cached"):
        labels, hit = cached_labels(seqs, out_w, te.TOPK, 30, ro, compute)
    assert not hit and all(torch.equal(a[0], b[0]) for a, b in zip(labels, first))
    assert list((setup["root"] / "data" / CACHE_DIR).glob("eagle3-soft-labels-*.safetensors")), \
        "te.train keeps its labels beside the data"


def test_build_vocab_keeps_the_most_frequent_response_tokens():
    from verispec.train.shards import TrainSequence

    z = torch.zeros(6, 2)
    seqs = [TrainSequence(torch.tensor([9, 9, 9, 4, 4, 7]), 1, {}, z),  # the prompt token 9 does not count
            TrainSequence(torch.tensor([1, 4, 2, 2, 2]), 1, {}, z[:5])]
    d2t, t2d = te.build_vocab(seqs, 3, 10)  # counts: 2 x3, 4 x3, 9 x2, 7 x1
    assert torch.nonzero(t2d).flatten().tolist() == [2, 4, 9]
    assert (torch.arange(3) + d2t).tolist() == [2, 4, 9]


@pytest.mark.parametrize("scheduler", ["static", "dspark"])
def test_greedy_output_equals_hf_with_state_oracle(setup, scheduler):
    """6 requests on 4 slots, 8-token batches (chunked prefill hands features over in pieces), state oracle on."""
    head_dir = str(setup["root"] / "head")
    llm = LLM(str(setup["root"] / "target"), dtype="float32", max_model_len=128, max_num_seqs=4, progress=False,
              speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 4},
              check_state=True, scheduler=scheduler, max_num_batched_tokens=8)
    prompts = [p["ids"] + p["ids"][:3] for p in setup["prompts"][:6]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * 6, use_tqdm=False)
    taus = []
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(setup["hf"], p, MAX_NEW)
        taus.append(o.stats["mean_acceptance_length"])
    if scheduler == "static":  # the dspark scheduler may switch drafting off from the profiled (load-dependent) costs
        assert max(taus) > 1.2, "the trained head should get drafts accepted (else multi-token commits go untested)"
    assert llm.engine.kv_tokens() == 0


def test_hybrid_drafting_equals_hf_with_state_oracle_and_both_sides_draft(setup):
    """n-gram drafts first, the head where the policy verifies none of them (static K = 3: wherever n-gram has no
    match): 6 requests on 4 slots, chunked prefill, the head's features and K/V checked after every step."""
    head_dir = str(setup["root"] / "head")
    llm = LLM(str(setup["root"] / "target"), dtype="float32", max_model_len=128, max_num_seqs=4, progress=False,
              speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 3,
                                  "hybrid": "ngram", "prompt_lookup_min": 2},
              check_state=True, scheduler="static", max_num_batched_tokens=8)
    drafters = []
    new = llm.drafters.new
    llm.drafters.new = lambda params, n: drafters.append(new(params, n)) or drafters[-1]  # type: ignore[method-assign]
    prompts = [p["ids"] + p["ids"][:3] for p in setup["prompts"][:6]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * 6, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(setup["hf"], p, MAX_NEW)
    free = sum(d.proposals["free"] for d in drafters)
    model = sum(d.proposals["model"] for d in drafters)
    assert free > 0 and model > 0, f"both sides must have drafted (n-gram {free}, head {model})"
    side = sum(o.stats["hybrid_model_draft_tokens"] for o in outs)  # the head's share of the verified drafts
    assert 0 < side < sum(o.stats["num_draft_tokens"] for o in outs)
    assert sum(o.stats["hybrid_model_accepted_tokens"] for o in outs) <= side
    assert sum(o.stats["num_accepted_tokens"] for o in outs) > 0
    assert llm.engine.kv_tokens() == 0


def test_state_oracle_catches_a_stale_drafter_position(setup):
    """Negative control: corrupt one committed K/V row of the head; the oracle must name it."""
    from verispec.execution.features import target_features

    llm = setup["llm"]
    head = load(setup["root"] / "head", llm.model)
    d = Eagle3Drafter(head, SamplingParams(temperature=0), max_len=64)
    ids = setup["prompts"][0]["ids"]
    feats, _ = target_features(llm.model, ids, head.feature_layers)
    d.add_features(feats[:-1])
    d.propose(ids, 3)
    d.observe(0)  # the target rejected every draft: the pending token is committed, with its features
    d.add_features(feats[-1:])
    d.check_state(feats, ids)  # consistent
    d.k[2] += 0.5
    with pytest.raises(AssertionError, match="K of position 2"):
        d.check_state(feats, ids)


def test_ttt_unroll_matches_inference_drafting(setup):
    """Step i, index j of the training unroll = the drafter's logits for draft token i + 1 after context x_0..x_{j+1},
    when the sequence continues with the drafter's own drafts."""
    llm = setup["llm"]
    head = load(setup["root"] / "head", llm.model)
    seq = load_all(setup["root"] / "data")[0]
    j = 11
    ctx = seq.ids[: j + 2].tolist()
    feats = seq.features(head.feature_layers)
    d = Eagle3Drafter(head, SamplingParams(temperature=0), max_len=64)
    d.add_features(feats[: j + 1])
    steps = 3
    # the drafter's logits at each draft position, recorded around its own loop
    seen: list[torch.Tensor] = []
    orig = head.logits
    head.logits = lambda h: (seen.append(orig(h)), seen[-1])[1]  # type: ignore[method-assign]
    try:
        draft = d.propose(ctx, steps)
    finally:
        head.logits = orig  # type: ignore[method-assign]
    ids = torch.tensor(ctx + draft.tokens)
    f = torch.cat([feats[: j + 1], torch.randn(len(ids) - j - 1, feats.shape[1])])  # later features unused
    with torch.no_grad():
        unrolled = te.ttt_logits(head, f, ids, steps)
    for i in range(steps):
        torch.testing.assert_close(unrolled[i][j], seen[i][0], atol=1e-4, rtol=1e-4)


def _reference_eagle3(sd: dict, cfg: dict, embed: torch.Tensor, feats: torch.Tensor, ids: torch.Tensor,
                      rope_cos: torch.Tensor, rope_sin: torch.Tensor) -> torch.Tensor:
    """EAGLE-3's layer written from the paper and vLLM's layout, reading only the exported names."""
    eps, H, K, hd = cfg["rms_norm_eps"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rot(x, n):  # HF's rotate_half convention, with the plain sine of each frequency
        cos = rope_cos[:n, None, :]
        s = rope_sin[:n, None, hd // 2 :]  # the table's second half holds +sin
        x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * torch.cat([s, s], -1)

    n = ids.shape[0]
    h = feats @ sd["fc.weight"].float().t()
    u = torch.cat([norm(embed[ids], sd["layers.0.input_layernorm.weight"].float()),
                   norm(h, sd["layers.0.hidden_norm.weight"].float())], -1)
    a = "layers.0.self_attn."
    q = rot((u @ sd[a + "q_proj.weight"].float().t()).view(n, H, hd), n)
    k = rot((u @ sd[a + "k_proj.weight"].float().t()).view(n, K, hd), n).repeat_interleave(H // K, 1)
    v = (u @ sd[a + "v_proj.weight"].float().t()).view(n, K, hd).repeat_interleave(H // K, 1)
    s = torch.einsum("nhd,mhd->hnm", q, k) / math.sqrt(hd)
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    att = torch.einsum("hnm,mhd->nhd", s.softmax(-1), v).reshape(n, H * hd)
    x = h + att @ sd[a + "o_proj.weight"].float().t()
    m = norm(x, sd["layers.0.post_attention_layernorm.weight"].float())
    mlp = F.silu(m @ sd["layers.0.mlp.gate_proj.weight"].float().t()) * (m @ sd["layers.0.mlp.up_proj.weight"].float().t())
    x = x + mlp @ sd["layers.0.mlp.down_proj.weight"].float().t()
    return norm(x, sd["norm.weight"].float()) @ sd["lm_head.weight"].float().t()  # [n, Vd]


def test_export_reads_back_under_vllm_and_sglang_names(setup, tmp_path):
    llm = setup["llm"]
    # a 3-aux-layer head, as vLLM / SGLang require
    cfg = Eagle3Config.for_target(llm.model, (1, 3, 4), draft_vocab_size=40)
    torch.manual_seed(5)
    head = Eagle3Head(cfg, llm.model)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
        chosen = torch.arange(5, 45)
        head.d2t.copy_(chosen - torch.arange(40))
        head.t2d[chosen] = True
    head.save_pretrained(tmp_path / "ckpt")
    out = export_from_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "export"), dtype=torch.float32)
    conf = json.loads((out / "config.json").read_text())
    sd = load_file(str(out / "model.safetensors"))
    assert conf["architectures"] == ["LlamaForCausalLMEagle3"] and conf["num_hidden_layers"] == 1
    assert conf["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4] == conf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert conf["draft_vocab_size"] == 40 and conf["vocab_size"] == 60 and conf["target_hidden_size"] == 32
    d = cfg.hidden_size
    assert sd["fc.weight"].shape == (d, 3 * d)
    assert sd["layers.0.self_attn.q_proj.weight"].shape == (cfg.num_heads * cfg.head_dim, 2 * d)
    assert sd["lm_head.weight"].shape == (40, d)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and int(sd["t2d"].sum()) == 40
    assert (torch.arange(40) + sd["d2t"]).tolist() == torch.nonzero(sd["t2d"]).flatten().tolist()
    assert not any("embed" in k for k in sd), "the embedding is the target's and must not be exported"
    # the exported tensors, used by their names, compute what our head computes
    ids = torch.tensor([3, 17, 22, 9, 41, 5, 8])
    feats = torch.randn(len(ids), 3 * d)
    ref = _reference_eagle3(sd, conf, llm.model.embed.float(), feats, ids, llm.model.rope_cos, llm.model.rope_sin)
    with torch.no_grad():
        ours = te.ttt_logits(head, torch.cat([feats, feats[-1:]]), torch.cat([torch.tensor([0]), ids]), 1)[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_loading_a_head_for_another_target_is_refused(setup, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from verispec.models.loader import load_model

    other_cfg = LlamaConfig(vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                            num_attention_heads=4, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(other_cfg).save_pretrained(tmp_path / "other")
    other, _ = load_model(str(tmp_path / "other"), dtype="float32", device="cpu", progress=False)
    with pytest.raises(ValueError, match="trained for a target"):
        load(setup["root"] / "head", other)


def _path(tree, i: int) -> tuple[int, ...]:
    """The tokens from the root to node i of a TreeDraft or a growing tree."""
    tokens, parents = (tree.tokens, tree.parents) if hasattr(tree, "tokens") else (tree.token, tree.parent)
    out = []
    while i >= 0:
        out.append(tokens[i])
        i = parents[i]
    return tuple(reversed(out))


def _head_at_a_context(setup):
    """The trained head, a context of j + 2 tokens from its training data, that sequence's features and j (a
    drafter for the context is fed features[: j + 1])."""
    head = load(setup["root"] / "head", setup["llm"].model)
    seq = load_all(setup["root"] / "data")[1]
    j = 9
    return head, seq.ids[: j + 2].tolist(), seq.features(head.feature_layers).float(), j


@pytest.mark.parametrize("width", [1, 4])
def test_tree_is_eagle2_selection_over_independently_scored_paths(setup, width):
    """The drafter's tree (one batched head run per depth, tree-masked scratch K/V) against EAGLE-2's selection
    simulated here, with every path's log-probability from the training unroll teacher-forced on that path. Width 1
    expands one chain (no mask needed), width 4 several branches per depth (each sees only its own ancestors)."""
    from verispec.drafters.tree_growth import TREE_TOPK, frontier_width

    head, ctx, feats, j = _head_at_a_context(setup)
    budget, depth = 6, 3

    def logp(path: tuple[int, ...]) -> torch.Tensor:  # [Vd] draft log-probabilities after ctx + path
        ids = torch.tensor(ctx + list(path) + [0])
        f = torch.cat([feats[: j + 1], torch.zeros(len(ids) - j - 1, feats.shape[1])])  # later features unused
        with torch.no_grad():
            return torch.log_softmax(te.ttt_logits(head, f, ids, len(path) + 1)[len(path)][j], -1)

    scores = eagle2_scores(logp, depth, TREE_TOPK, width, head.to_target_ids)
    want = best_paths(scores, budget)

    d = Eagle3Drafter(head, SamplingParams(temperature=0), max_len=64)
    d.add_features(feats[: j + 1])
    grown = d._grow(ctx, budget, depth, width)  # every candidate, with the score the drafter gave it
    paths = [_path(grown, i) for i in range(len(grown.token))]
    assert set(paths) == set(scores)
    for path, score in zip(paths, grown.score):
        assert abs(score - scores[path]) < 1e-4, path
    d = Eagle3Drafter(head, SamplingParams(temperature=0), max_len=64)
    d.add_features(feats[: j + 1])
    tree = d.propose_tree(ctx, budget, depth, None if width == frontier_width(budget) else width)
    got = {_path(tree, i) for i in range(len(tree.tokens))}
    assert got == want and len(tree.tokens) == budget
    assert max(len(p) for p in got) > 1 and len({p[0] for p in got}) > 1  # a real tree: deep and branching


def test_a_sampled_tree_draws_its_children_without_replacement(setup):
    """At T > 0 the children are drawn from the head's q (not its top-k): rows as draws without replacement, the
    root's children from the q the chain draws its first token from, and a greedy tree carries no rows."""
    head, ctx, feats, j = _head_at_a_context(setup)

    def drafter(params):
        d = Eagle3Drafter(head, params, max_len=64)
        d.add_features(feats[: j + 1])
        return d

    params = SamplingParams(temperature=1.0, seed=4)
    chain = drafter(params).propose(ctx, 1)
    trees = [drafter(SamplingParams(temperature=1.0, seed=s)).propose_tree(ctx, 6, 3) for s in range(4)]
    for tree in trees:
        assert len(tree.tokens) == 6
        assert_drawn_without_replacement(tree, chain.probs[0])
    assert len({t.tokens for t in trees}) > 1  # drawn, not the top-k
    assert drafter(SamplingParams(temperature=0)).propose_tree(ctx, 6, 3).probs is None


def test_tree_drafting_in_the_engine_equals_hf_with_state_oracle(setup, monkeypatch):
    head_dir = str(setup["root"] / "head")
    llm = LLM(str(setup["root"] / "target"), dtype="float32", max_model_len=128, max_num_seqs=4, progress=False,
              speculative_config={"method": "eagle3", "model": head_dir, "num_speculative_tokens": 6,
                                  "draft_tree": True}, check_state=True, max_num_batched_tokens=16, scheduler="static")
    prompts = [p["ids"] + p["ids"][:3] for p in setup["prompts"][:6]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * 6, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(setup["hf"], p, MAX_NEW)
    assert max(o.stats["mean_acceptance_length"] for o in outs) > 1.2
    sampled = [SamplingParams(temperature=0.8, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)]
    import verispec.engine.core as core

    rows, real = [], core.verify_tree
    monkeypatch.setattr(core, "verify_tree", lambda tree, *a: rows.append(tree.probs is not None) or real(tree, *a))
    a = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sampled, use_tqdm=False)
    assert rows and all(rows)  # the drawn children's rows reach the verifier
    b = llm.generate([{"prompt_token_ids": p} for p in prompts[:3]], sampled, use_tqdm=False)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert llm.engine.kv_tokens() == 0


def test_a_q8_0_head_drafts_like_the_float_head_and_stays_lossless(setup):
    """`quantize_q8act` (the head beside a gguf-q8act target): every linear, on the kernel with int8 activations,
    stays within 2% of the float product, the head's logits mostly agree on the top token, and the engine's greedy
    output still equals HF's with the state oracle on (the drafter's state is recomputed with the same head)."""
    from verispec.drafters.eagle3 import LINEARS

    llm, head_dir = setup["llm"], str(setup["root"] / "head")
    dense, rounded = load(head_dir, llm.model), load(head_dir, llm.model)
    rounded.quantize_q8act()
    g = torch.Generator().manual_seed(3)
    for name in LINEARS:
        w = getattr(dense, name).weight  # [N, K]
        x = torch.randn(5, w.shape[1], generator=g)
        want = x @ w.t()
        assert (getattr(rounded, name)(x) - want).norm() < 0.02 * want.norm(), name
    h = torch.randn(200, 32, generator=g)
    a, b = dense.logits(h), rounded.logits(h)
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ValueError, match="Q8_0"):
        rounded.save_pretrained(setup["root"] / "never")

    spec = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": 4}
    eng = LLM(str(setup["root"] / "target"), dtype="float32", max_model_len=128, max_num_seqs=4, progress=False,
              speculative_config=spec, check_state=True, scheduler="static", max_num_batched_tokens=8)
    eng.drafters.learned.quantize_q8act()
    prompts = [p["ids"] + p["ids"][:3] for p in setup["prompts"][:6]]
    outs = eng.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)] * 6, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(setup["hf"], p, MAX_NEW)
    assert max(o.stats["mean_acceptance_length"] for o in outs) > 1.2, "the rounded head still gets drafts accepted"


def test_the_drafters_block_format_is_the_users_choice_and_refused_where_it_cannot_apply(setup):
    """speculative_config "quantization" reaches the loader: beside a target on the kernel each choice rounds every
    linear of the head to that format (none named: the default); beside a float target the head stays float and
    naming a format is an error, as is naming one for a drafter that is not learned, or one that does not exist."""
    from verispec.config import DEFAULT_DRAFT_QUANTIZATION, SpeculativeConfig
    from verispec.drafters import load_learned
    from verispec.drafters.eagle3 import LINEARS
    from verispec.kernels.q8act import Q8ActWeight

    llm, head_dir = setup["llm"], str(setup["root"] / "head")
    target = llm.model
    assert not isinstance(load_learned("eagle3", head_dir, target).lm_head, Q8ActWeight)
    with pytest.raises(ValueError, match="gguf-q8act"):
        load_learned("eagle3", head_dir, target, "q4_0")
    target.decoder_kernel = object()  # what load reads to tell a target on the kernel
    try:
        for name, kind in [(None, DEFAULT_DRAFT_QUANTIZATION.upper()), ("q8_0", "Q8_0"), ("q4_1", "Q4_1")]:
            head = load_learned("eagle3", head_dir, target, name)
            assert {getattr(head, n).kind for n in LINEARS} == {kind} and head.kernel.qkv_feat.kind == kind, name
        with pytest.raises(ValueError, match="Q4_1 blocks"):  # a rounded head is not a checkpoint
            head.save_pretrained(setup["root"] / "never-q4")
    finally:
        target.decoder_kernel = None
    for bad, match in [({"method": "ngram", "quantization": "q4_0"}, "learned"),
                       ({"method": "eagle3", "model": head_dir, "quantization": "int4"}, "q8_0, q4_1, q4_0")]:
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(bad)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_the_kernel_step_computes_the_heads_layer(setup, kind):
    """Beside a gguf-q8act target the rounded head drafts through a few kernel calls (drafters/eagle3_kernel.py):
    q | k | v split at d along K with both norms fused, RoPE in place, vs_attention, fused residuals and SwiGLU.
    Against the same rounded head's torch ops (separate q, k, v, gate and up weights; torch norms, RoPE, attention
    and SwiGLU), for one row, a causal block and a draft tree's mask: the K/V written, the layer's output and the
    logits agree to the rounding of the int8 activations, and the kernel writes no row it was not given."""
    from verispec.drafters.eagle3 import attend

    llm = setup["llm"]
    head = load(str(setup["root"] / "head"), llm.model)
    head.quantize_q8act(kind)
    kern = head.kernel
    assert kern is not None and kern.gate_up.kind == head.lm_head.kind == kind
    c = head.cfg
    g = torch.Generator().manual_seed(5)
    m = 20  # committed positions with K/V already in the caches
    ctx_emb = head.embed(torch.randint(1, 60, (m,), generator=g))
    ctx_feat = torch.randn(m, c.hidden_size, generator=g)
    _, k0, v0 = head.qkv(ctx_emb, ctx_feat, torch.arange(m))
    caches = torch.zeros(2, m + 8, c.num_kv_heads, c.head_dim)
    caches[0, :m], caches[1, :m] = k0, v0

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).norm() / b.norm())

    tree = torch.ones(3, m + 3, dtype=torch.bool)  # root (row m), two children of it (rows m + 1, m + 2)
    tree[:, :m] = False
    tree[:, m] = False
    tree[1, m + 1] = tree[2, m + 2] = False
    cases = {
        "one row": (torch.tensor([m]), None),
        "causal block": (torch.arange(m, m + 3), torch.arange(m + 3)[None, :] > torch.arange(m, m + 3)[:, None]),
        "tree": (torch.tensor([m, m + 1, m + 1]), tree),
    }
    for name, (pos, blocked) in cases.items():
        n = pos.shape[0]
        emb = head.embed(torch.randint(1, 60, (n,), generator=g))
        feat = torch.randn(n, c.hidden_size, generator=g)
        kc, vc = caches[0].clone(), caches[1].clone()
        out = kern.run(emb, feat, pos, slice(m, m + n), kc, vc, m + n, blocked)
        q, k, v = head.qkv(emb, feat, pos)
        rk, rv = caches[0].clone(), caches[1].clone()
        rk[m : m + n], rv[m : m + n] = k, v
        want = head.post(feat, attend(q, rk[: m + n], rv[: m + n], blocked))
        assert torch.equal(kc[:m], caches[0, :m]) and torch.equal(kc[m + n :], caches[0, m + n :]), name
        assert rel(kc[m : m + n], k) < 1e-3 and rel(vc[m : m + n], v) < 1e-3, name
        assert rel(out, want) < 2e-3, name
        ref_logits = head.lm_head(F.rms_norm(want, (c.hidden_size,), head.norm, c.rms_norm_eps)).float()
        assert rel(kern.logits(out), ref_logits) < 5e-3, name
        assert torch.equal(head.logits(out), kern.logits(out)), "the rounded head's logits are the kernel's"


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_confidences_are_the_drafted_tokens_probabilities_and_min_survival_cuts_the_chain(setup, temperature):
    """Each position's confidence is the head's probability of the token it drafted (greedy: the softmax top-1 of
    its logits, recomputed here from the logits the head produced; sampled: q of that token). With min_survival s
    the drafter stops after the first token at which the running product falls below s: the same tokens, cut."""
    llm = setup["llm"]
    head = load(setup["root"] / "head", llm.model)
    seq = load_all(setup["root"] / "data")[0]
    j = 9
    ctx, feats = seq.ids[: j + 2].tolist(), seq.features(head.feature_layers)[: j + 1]

    def drafter():
        d = Eagle3Drafter(head, SamplingParams(temperature=temperature, seed=3), max_len=64)
        d.add_features(feats)
        return d

    seen: list[torch.Tensor] = []
    orig = head.logits
    head.logits = lambda h: (seen.append(orig(h)), seen[-1])[1]  # type: ignore[method-assign]
    try:
        full = drafter().propose(ctx, 6)
    finally:
        head.logits = orig  # type: ignore[method-assign]
    assert len(full.tokens) == 6 and len(full.confidence) == 6
    for i, t in enumerate(full.tokens):
        want = F.softmax(seen[i][0].float(), -1).max() if temperature == 0 else full.probs[i, t]
        assert full.confidence[i] == pytest.approx(float(want), rel=1e-5)
    surv = torch.tensor(full.confidence).cumprod(0).tolist()
    for s in (surv[0] / 2, (surv[1] + surv[2]) / 2, surv[-1] / 2, 1.01):
        cut = drafter().propose(ctx, 6, min_survival=s)
        n = next((i + 1 for i, v in enumerate(surv) if v < s), 6)
        assert cut.tokens == full.tokens[:n] and cut.confidence == pytest.approx(full.confidence[:n])
