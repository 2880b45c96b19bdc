"""DFlash / DSpark: training lowers held-out loss, the batched training forward equals the drafter's block forward,
the drafter's context state matches a from-scratch recomputation, checkpoints round-trip and refuse a wrong
target, ECE and calibration, left-to-right Markov decoding, and a greedy speculative loop equal to HF generate."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import hf_greedy, self_distilled_data, sharp_llama
from verispec.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel, TargetParts, load
from verispec.drafters.features import select, target_features
from verispec.models.llama import Segment
from verispec.models.loader import load_model
from verispec.execution.sampling import SamplingParams
from verispec.train import dflash as tr
from verispec.train.calibrate import ece, fit_position_temperatures, per_position_ece
from verispec.train.shards import load_all

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)
GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(directory, HF model, our LlamaModel) of a random 6-layer Llama with sharp next-token distributions."""
    d = tmp_path_factory.mktemp("target")
    hf, model = sharp_llama(d, 11, **COMMON)
    return str(d), hf, model


@pytest.fixture(scope="module")
def data_dir(tiny, tmp_path_factory):
    """24 self-distilled sequences (random prompt + the target's greedy response) with every layer's states."""
    path, hf, model = tiny
    return self_distilled_data(hf, model, path, tmp_path_factory.mktemp("data"), 24, 12)


def new_model(target, dspark=False, block_size=8, seed=0, dtype=torch.float32) -> DFlashModel:
    torch.manual_seed(seed)
    cfg = DFlashConfig.for_target(target.cfg, num_layers=2, block_size=block_size, dspark=dspark, markov_rank=16)
    return DFlashModel(cfg, TargetParts.of(target, dtype=dtype))


@pytest.fixture(scope="module")
def trained(tiny, data_dir):
    """{method: (model, log)} trained 60 steps each on the tiny data."""
    _, _, target = tiny
    seqs = load_all(data_dir)
    out = {}
    for method in ("dflash", "dspark"):
        m = new_model(target, dspark=method == "dspark")
        tc = tr.TrainConfig(steps=60, lr=3e-3, warmup=5, anchors_per_seq=8, seqs_per_step=4, eval_every=30)
        log = tr.train_model(m, seqs, tc, progress=False)
        if method == "dspark":
            _, held = tr.split(seqs, tc.heldout_frac, tc.seed)
            log["calibration"] = tr.calibrate(m, tr.fixed_batches(m, held, tc, torch.device("cpu")))
        out[method] = (m, log)
    return out


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_training_lowers_heldout_loss(trained, method):
    _, log = trained[method]
    first, last = log["heldout"][0], log["heldout"][-1]
    assert last["step"] == 60 and log["steps"] == 60 and len(log["loss"]) == 60
    assert last["loss"] < 0.7 * first["loss"], f"{method}: held-out loss {first['loss']:.3f} -> {last['loss']:.3f}"
    assert last["acc"] > first["acc"]


def test_dflash_loss_weights_match_hand_computation(tiny, data_dir):
    _, _, target = tiny
    m = new_model(target, block_size=4)
    seq = load_all(data_dir)[0]
    b = tr.make_batch([seq], [[seq.prompt_len + 1]], m.cfg.feature_layers, 4, torch.device("cpu"))
    loss, _ = tr.compute_loss(m, b)
    h = m.forward_train(b.feats, b.ctx_pos, b.ctx_seq, b.anchors, b.anchor_pos, b.anchor_seq)[0, 1:]  # [3, d]
    ce = torch.nn.functional.cross_entropy(m.logits(h), seq.ids[seq.prompt_len + 2 : seq.prompt_len + 5],
                                           reduction="none")
    w = torch.exp(-torch.arange(3.0) / 2.0)  # gamma = B / 2 = 2 for B = 4
    assert torch.allclose(loss, (w * ce).sum() / w.sum(), atol=1e-6)
    assert tr.gamma_for(16) == 7 and tr.gamma_for(8) == 4 and tr.gamma_for(6) == 3


# ---------------------------------------------------------------- training forward == inference forward


@pytest.mark.parametrize("dspark", [False, True])
def test_batched_training_forward_equals_drafter_block(tiny, data_dir, dspark):
    _, _, target = tiny
    m = new_model(target, dspark=dspark, seed=3).eval()
    seqs = load_all(data_dir)[:2]
    anchors = [[seqs[0].prompt_len, seqs[0].prompt_len + 7, len(seqs[0].ids) - 3], [seqs[1].prompt_len + 2]]
    b = tr.make_batch(seqs, anchors, m.cfg.feature_layers, 8, torch.device("cpu"))
    with torch.no_grad():
        h_train = m.forward_train(b.feats, b.ctx_pos, b.ctx_seq, b.anchors, b.anchor_pos, b.anchor_seq)
    row = 0
    for seq, anc in zip(seqs, anchors):
        feats = seq.features(m.cfg.feature_layers)
        for a in anc:
            d = DFlashDrafter(m, GREEDY)
            d.add_features(feats[: a // 2])  # in two chunks, as prefill chunks would arrive
            d.add_features(feats[a // 2 : a])
            h, U = d.block(int(seq.ids[a]), a)
            assert torch.allclose(h, h_train[row], atol=1e-5), f"anchor {a}: max diff {(h - h_train[row]).abs().max()}"
            assert torch.allclose(U, m.logits(h_train[row, 1:]), atol=1e-4)
            row += 1


# ---------------------------------------------------------------- drafter state


def test_check_state_passes_and_catches_corruption(tiny, data_dir):
    _, _, target = tiny
    m = new_model(target, seed=4)
    seq = load_all(data_dir)[0]
    feats = seq.features(m.cfg.feature_layers)
    d = DFlashDrafter(m, GREEDY)
    for lo, hi in ((0, 5), (5, 6), (6, 20)):
        d.add_features(feats[lo:hi])
        d.check_state(feats[:hi])
    assert len(d.propose(seq.ids[:21].tolist(), 5).tokens) == 5
    assert len(d.propose(seq.ids[:21].tolist(), 50).tokens) == 7  # at most B - 1
    with pytest.raises(AssertionError, match="holds context K/V for 20 positions but 19"):
        d.check_state(feats[:19])
    with pytest.raises(AssertionError, match="needs exactly 21"):
        d.propose(seq.ids[:22].tolist(), 3)
    with torch.inference_mode():
        d._v[1][13, 0, 0] += 1.0  # a stale slot
    with pytest.raises(AssertionError, match="V of draft layer 1 differs at position 13 of 20"):
        d.check_state(feats[:20])
    d.release()


def test_sampled_drafts_carry_their_distributions(trained):
    for method in ("dflash", "dspark"):
        m, _ = trained[method]
        d = DFlashDrafter(m, SamplingParams(temperature=0.8, top_k=10, seed=1))
        d.add_features(torch.randn(9, len(m.cfg.feature_layers) * m.cfg.hidden_size))
        draft = d.propose(list(range(1, 11)), 5)
        assert len(draft.tokens) == 5 and draft.probs is not None and draft.probs.shape == (5, 64)
        assert torch.allclose(draft.probs.sum(-1), torch.ones(5), atol=1e-5)
        assert all(draft.probs[i, t] > 0 for i, t in enumerate(draft.tokens))
        assert all(int((row > 0).sum()) <= 10 for row in draft.probs)  # top-k applied to q as to p
        if method == "dspark":
            assert draft.confidence is not None and all(0 < c < 1 for c in draft.confidence)
        else:
            assert draft.confidence is None


# ---------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_and_wrong_target_refused(trained, tiny, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    _, _, target = tiny
    m, _ = trained["dspark"]
    m.save_pretrained(tmp_path / "ck")
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert raw["architectures"] == ["DSparkDraftModel"] and raw["block_size"] == 8
    assert raw["dflash_config"]["target_layer_ids"] == list(m.cfg.target_layer_ids)
    assert raw["dspark_config"]["confidence_temperatures"] == list(m.cfg.confidence_temperatures)
    sd = load_file(str(tmp_path / "ck" / "model.safetensors"))
    assert set(sd) == set(m.state_dict()) and not any("embed_tokens" in k or "lm_head" in k for k in sd)
    assert not any(v.shape == target.embed.shape and torch.equal(v, target.embed) for v in sd.values())
    m2 = load(tmp_path / "ck", target)
    assert m2.cfg == m.cfg and len(m2.cfg.confidence_temperatures) == 7
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    d1, d2 = DFlashDrafter(m, GREEDY), DFlashDrafter(m2, GREEDY)
    feats = torch.randn(6, len(m.cfg.feature_layers) * 32)
    d1.add_features(feats)
    d2.add_features(feats)
    assert d1.propose(list(range(7)), 7) == d2.propose(list(range(7)), 7)

    for change in ({"hidden_size": 48}, {"vocab_size": 70}):
        other = tmp_path / f"other{len(change)}{next(iter(change))}"
        AutoModelForCausalLM.from_config(LlamaConfig(**{**COMMON, **change})).save_pretrained(other)
        wrong, _ = load_model(str(other), dtype="float32")
        with pytest.raises(ValueError, match="trained for a target with hidden size 32, vocabulary 64"):
            load(tmp_path / "ck", wrong)


def test_cli_run_writes_checkpoint_and_log(tiny, data_dir, tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    tr.add_args(p, "dspark")
    args = p.parse_args(["--data", str(data_dir), "--out", str(tmp_path / "ck"), "--quick", "--steps", "4",
                         "--block-size", "4", "--markov-rank", "8", "--device", "cpu"])
    tr.run(args, "dspark")
    log = json.loads((tmp_path / "ck" / "train_log.json").read_text())
    assert log["steps"] == 4 and log["data"] == str(data_dir) and "ece_after" in log["calibration"]
    m = load(tmp_path / "ck", tiny[2])
    assert m.cfg.dspark and m.cfg.num_layers == 1 and m.cfg.block_size == 4


# ---------------------------------------------------------------- calibration


def test_ece_equals_hand_computation():
    p = torch.tensor([0.05, 0.15, 0.12, 0.95, 0.91, 0.5, 1.0])
    y = torch.tensor([0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0])
    # bins: 0 {0.05}, 1 {0.15, 0.12}, 5 {0.5}, 9 {0.95, 0.91, 1.0}
    hand = (abs(0.05 - 0) + abs(0.27 - 1) + abs(0.5 - 0) + abs(2.86 - 3)) / 7
    assert ece(p, y) == pytest.approx(hand, abs=1e-7)  # float32 inputs
    assert ece(torch.tensor([0.3, 0.3]), torch.tensor([0.0, 1.0]), bins=2) == pytest.approx(0.2)


def test_calibration_lowers_ece_on_rows_it_was_not_fitted_on():
    g = torch.Generator().manual_seed(0)
    N, K = 4000, 5
    true_logit = torch.randn(N, K, generator=g) + 1.0
    step_survives = torch.rand(N, K, generator=g) < torch.sigmoid(true_logit)
    survival = step_survives.long().cumprod(1).float()
    raw = 3.0 * true_logit  # overconfident head
    valid = torch.ones(N, K, dtype=torch.bool)
    temps = fit_position_temperatures(raw[::2], survival[::2], valid[::2])  # fitted on one half,
    before = per_position_ece(raw[1::2], survival[1::2], valid[1::2], torch.ones(K))  # scored on the other
    after = per_position_ece(raw[1::2], survival[1::2], valid[1::2], torch.tensor(temps))
    assert after[0] <= before[0] and sum(after) < 0.5 * sum(before)
    assert all(2.0 < t < 4.5 for t in temps[:2]), temps


def test_dspark_calibration_on_heldout(trained):
    m, log = trained["dspark"]
    cal = log["calibration"]
    assert cal["ece_after"][0] <= cal["ece_before"][0] + 1e-12
    assert cal["mean_ece_after"] <= cal["mean_ece_before"]
    assert list(m.cfg.confidence_temperatures) == cal["temperatures"]


# ---------------------------------------------------------------- Markov head


def test_markov_head_decodes_left_to_right(tiny):
    _, _, target = tiny
    m = new_model(target, dspark=True, seed=6)
    head = m.markov
    torch.nn.init.normal_(head.w2.weight)  # a trained (non-zero) W2
    U, h = torch.randn(1, 4, 64), torch.randn(1, 4, 32)
    anchor = torch.tensor([9])

    def forced(t2: int):
        seen = []

        def choose(z, k):
            seen.append(z.clone())
            return torch.tensor([t2]) if k == 1 else z.argmax(-1)

        toks, z, conf = head.decode(U, h, anchor, choose)
        return toks, z, conf, seen

    with torch.no_grad():
        ta, za, ca, _ = forced(3)
        tb, zb, cb, _ = forced(40)
        assert torch.equal(za[:, :2], zb[:, :2]) and torch.equal(ca[:, :2], cb[:, :2])  # positions 1, 2 unchanged
        assert torch.allclose(za[0, 2], U[0, 2] + head.bias(torch.tensor(3)), atol=1e-6)  # B_3 read from x_2
        assert torch.allclose(zb[0, 2], U[0, 2] + head.bias(torch.tensor(40)), atol=1e-6)
        assert not torch.allclose(za[0, 2], zb[0, 2]) and not torch.allclose(ca[0, 2], cb[0, 2])


def test_dspark_greedy_draft_is_sequential_argmax(trained):
    m, _ = trained["dspark"]
    d = DFlashDrafter(m, GREEDY)
    d.add_features(torch.randn(7, len(m.cfg.feature_layers) * 32))
    ctx = [5, 6, 7, 8, 9, 10, 11, 12]
    draft = d.propose(ctx, 7)
    h, U = d.block(ctx[-1], 7)
    prev, want = ctx[-1], []
    with torch.no_grad():
        for k in range(7):
            prev = int((U[k] + m.markov.bias(torch.tensor(prev))).argmax())
            want.append(prev)
    assert draft.tokens == want
    T = torch.tensor(m.cfg.confidence_temperatures)
    assert len(draft.confidence) == 7 and max(abs(c - float(torch.sigmoid(x))) for c, x in zip(
        draft.confidence, m.markov.conf_logits(h[1:], torch.tensor([ctx[-1]] + want[:-1])).detach() / T)) < 1e-6


# ---------------------------------------------------------------- speculative loop (no engine)


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_greedy_speculative_loop_equals_hf_generate(trained, tiny, method):
    """A minimal greedy loop over the drafter protocol: add_features after every commit (the pending token plus the
    accepted drafts), check_state against a from-scratch recomputation each step; output == HF generate."""
    _, hf, target = tiny
    m, _ = trained[method]
    layers = m.cfg.feature_layers
    accepted_total = 0
    for prompt in ([1, 2, 3, 4, 5], [7, 7, 7], [30, 12, 44, 8, 19, 2, 50]):
        n_new = 24
        d = DFlashDrafter(m, GREEDY)
        cache = target.new_cache(64)
        slot = cache.allocate()
        out = target(torch.tensor(prompt), [Segment(slot, 0, len(prompt))], cache, capture_layers=layers)
        cache.commit(slot, len(prompt))
        d.add_features(select(out.hidden, layers))
        ctx = prompt + [int(out.logits[-1].argmax())]
        while len(ctx) - len(prompt) < n_new:
            draft = d.propose(ctx, 7).tokens
            block = [ctx[-1]] + draft
            start = len(ctx) - 1
            o = target(torch.tensor(block), [Segment(slot, start, len(block))], cache,
                       logits_indices=list(range(len(block))), capture_layers=layers)
            best = o.logits.argmax(-1).tolist()  # [len(block)]
            a = 0
            while a < len(draft) and draft[a] == best[a]:
                a += 1
            cache.commit(slot, a + 1)
            d.observe(a)
            d.add_features(select(o.hidden, layers, slice(0, a + 1)))
            ctx += draft[:a] + [best[a]]
            accepted_total += a
            d.check_state(target_features(target, ctx[:-1], layers)[0], ctx)
        assert ctx[len(prompt) : len(prompt) + n_new] == hf_greedy(hf, prompt, n_new), f"{method}, prompt {prompt}"
        d.release()
    assert accepted_total > 0, "no draft was ever accepted: the loop did not exercise multi-token commits"


@pytest.mark.parametrize("method", ["dflash", "dspark"])
@pytest.mark.parametrize("scheduler", ["static", "dspark"])
def test_engine_greedy_equals_hf_with_state_oracle(trained, tiny, tmp_path, method, scheduler):
    """Through the engine: 3 requests on 2 slots, 8-token batches (features arrive in prefill chunks), state oracle
    after every step; the output equals HF greedy."""
    from verispec import LLM, SamplingParams

    path, hf, _ = tiny
    m, _ = trained[method]
    m.save_pretrained(tmp_path / "ck")
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], [30, 12, 44, 8, 19, 2, 50, 3, 3, 9, 10, 11]]
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2, check_state=True,
              max_num_batched_tokens=8, scheduler=scheduler, progress=False,
              speculative_config={"method": method, "model": str(tmp_path / "ck"), "num_speculative_tokens": 5})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3, use_tqdm=False)
    for o, r in zip(outs, refs):
        assert o.token_ids == r
    if scheduler == "static":  # the dspark scheduler may switch drafting off from the profiled (load-dependent) costs
        assert max(o.stats["mean_acceptance_length"] for o in outs) > 1.0
    assert llm.engine.kv_tokens() == 0


@pytest.mark.parametrize("method", ["dflash"])
def test_engine_preemption_makes_a_new_drafter_that_gets_every_feature_again(trained, tiny, tmp_path, method):
    """A KV pool too small for three requests at once: requests are preempted and recomputed (prompt + output so
    far), their drafters made anew from the recomputed features; the state oracle runs after every step and the
    output still equals HF greedy."""
    from verispec import LLM, SamplingParams

    path, hf, model = tiny
    m, _ = trained[method]
    m.save_pretrained(tmp_path / "ck")
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], [30, 12, 44, 8, 19, 2, 50, 3, 3, 9, 10, 11]]
    refs = [hf_greedy(hf, p, 20) for p in prompts]
    c = model.cfg
    block_bytes = 2 * c.num_layers * c.num_kv_heads * 4 * c.head_dim * 4  # K and V, blocks of 4, fp32
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=3, check_state=True,
              max_num_batched_tokens=8, scheduler="static", progress=False, block_size=4,
              kv_cache_memory_bytes=14 * block_bytes,
              speculative_config={"method": method, "model": str(tmp_path / "ck"), "num_speculative_tokens": 5})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3, use_tqdm=False)
    assert [o.token_ids for o in outs] == refs
    assert llm.engine.num_preemptions > 0
