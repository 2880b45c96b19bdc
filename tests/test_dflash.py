"""DFlash / DSpark: training lowers held-out loss, the batched training forward equals the drafter's block forward,
the drafter's context state matches a from-scratch recomputation, checkpoints round-trip and refuse a wrong
target, ECE and calibration, left-to-right Markov decoding, and a greedy speculative loop equal to HF generate."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import (assert_drawn_without_replacement, best_paths, eagle2_scores, hf_greedy, self_distilled_data,
                           sharp_llama)
from verispec.drafters.dflash import DFlashConfig, DFlashDrafter, DFlashModel, TargetParts, load
from verispec.execution.features import select, target_features
from verispec.models.llama import Segment
from verispec.models.loader import load_model
from verispec.sampling import SamplingParams
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


def test_bf16_autocast_trains_like_float32_and_is_really_on(tiny, data_dir):
    """amp="bf16" on CPU: the same 12 steps from the same start as float32. Its losses differ from float32's (so
    autocast really ran: matmuls in bf16) but stay within a few percent, held-out loss falls as much, and the log
    says which precision ran."""
    _, _, target = tiny
    seqs = load_all(data_dir)
    logs = {}
    for amp in ("off", "bf16"):
        m = new_model(target, dspark=True)
        tc = tr.TrainConfig(steps=12, lr=3e-3, warmup=2, anchors_per_seq=8, seqs_per_step=4, eval_every=12, amp=amp)
        logs[amp] = tr.train_model(m, seqs, tc, progress=False)
        assert all(p.dtype == torch.float32 for p in m.parameters())  # master weights stay float32
    fp32, bf16 = logs["off"], logs["bf16"]
    assert (fp32["amp"], bf16["amp"]) == ("off", "bf16")
    assert bf16["loss"] != fp32["loss"]
    assert bf16["loss"] == pytest.approx(fp32["loss"], rel=0.05)
    drop = [log["heldout"][0]["loss"] - log["heldout"][-1]["loss"] for log in (fp32, bf16)]
    assert drop[0] > 0 and drop[1] == pytest.approx(drop[0], rel=0.15), drop


def test_amp_auto_is_bf16_where_the_cpu_computes_bf16(monkeypatch):
    """`--amp auto` (the CLI default): bf16 autocast on a CPU with AVX-512 BF16 or AMX-BF16, float32 on one
    without (AVX2 has no bf16 arithmetic); "bf16" and "off" as given; a bad name is refused."""
    from verispec.kernels import cpu
    from verispec.train.loop import LoopConfig, amp_choice

    def with_flags(*flags):
        monkeypatch.setattr(cpu, "cpu_info", lambda: cpu.CpuInfo("test CPU", flags, "AVX512"))
        return amp_choice("auto", torch.device("cpu"))

    assert with_flags("avx2", "fma", "avx512f", "avx512_bf16") == "bf16"
    assert with_flags("avx2", "amx_tile", "amx_bf16") == "bf16"
    assert with_flags("avx2", "fma", "avx512f", "avx512_vnni") == "off"
    assert (amp_choice("bf16", torch.device("cpu")), amp_choice("off", torch.device("cpu"))) == ("bf16", "off")
    with pytest.raises(ValueError, match="amp must be one of"):
        LoopConfig(steps=1, amp="fp16")


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


def test_markov_greedy_is_the_sequential_argmax_on_either_weight(tiny):
    """MarkovHead.greedy (one block, argmax, U_k as the kernel call's residual where W2 is a Q8ActWeight): its
    tokens are the sequential argmax of U_k + W2 W1[x_{k-1}] computed here in float64 for a float W2, and the
    tokens `decode` picks with argmax for a W2 rounded to Q8_0 blocks; its confidences are conf_logits' at the
    tokens chosen."""
    from verispec.drafters.dspark_head import MarkovHead
    from verispec.kernels.q8act import Q8ActWeight

    _, _, target = tiny
    head = new_model(target, dspark=True, seed=8).markov
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        head.w2.weight.copy_(torch.randn(64, 16, generator=g))
        W1, W2 = head.w1.weight.double(), head.w2.weight.double()
        for trial in range(20):
            U, h = torch.randn(5, 64, generator=g) * (0.3 if trial % 2 else 3.0), torch.randn(5, 32, generator=g)
            toks, conf = head.greedy(U, h, 7)
            prev, want = 7, []
            for k in range(5):
                prev = int((U[k].double() + W2 @ W1[prev]).argmax())
                want.append(prev)
            assert toks == want, trial
            assert torch.allclose(conf, head.conf_logits(h, torch.tensor([7] + want[:-1])), atol=1e-6)
        wide = MarkovHead(64, 32, 32)  # a rank Q8_0 blocks fit
        torch.nn.init.normal_(wide.w2.weight, generator=g)
        wide.w2 = Q8ActWeight.from_float(wide.w2.weight)
        for _ in range(10):
            U, h = torch.randn(5, 64, generator=g), torch.randn(5, 32, generator=g)
            toks, _, _ = wide.decode(U[None], h[None], torch.tensor([7]), lambda z, _k: z.argmax(-1))
            assert wide.greedy(U, h, 7)[0] == toks[0].tolist()


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


# ---------------------------------------------------------------- draft trees


def _tree_paths(tree) -> set[tuple[int, ...]]:
    out = set()
    for i in range(len(tree.tokens)):
        path, j = [], i
        while j >= 0:
            path.append(tree.tokens[j])
            j = tree.parents[j]
        out.add(tuple(reversed(path)))
    return out


@pytest.mark.parametrize("method", ["dflash", "dspark", "dflash2"])
def test_tree_is_the_most_probable_paths_scored_independently(trained, tiny, method):
    """Every path of up to `depth` tokens through each position's top-4 is scored here from the block's logits
    (DSpark: the Markov head's decode, teacher-forced on the path); the tree must be the `budget` best of them."""
    from verispec.drafters.dflash import TREE_TOPK

    import copy

    m = _with_selector(new_model(tiny[2])) if method == "dflash2" else copy.deepcopy(trained[method][0])
    if m.markov is not None:  # a strong Markov correction, so a tree that ignored it would pick other paths
        with torch.no_grad():
            m.markov.w2.weight.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(8))
    feats = torch.randn(7, len(m.cfg.feature_layers) * 32, generator=torch.Generator().manual_seed(4))
    ctx = [5, 6, 7, 8, 9, 10, 11, 12]
    budget, depth = 7, 3
    d = DFlashDrafter(m, GREEDY)
    d.add_features(feats)
    h, U = d.block(ctx[-1], 7)

    def logp(path: tuple[int, ...]) -> torch.Tensor:  # [V] log-probabilities of the token after ctx + path
        if m.selector is not None:  # the selector's step over the candidates, times DFlash's mass on them
            cand, z = _reference_steps(m, ctx[-1], U, h, list(path) + [0])[len(path)]
            lq = torch.log_softmax(U[len(path)].float(), -1)
            out = torch.full((lq.shape[0],), float("-inf"))
            out[cand] = torch.log_softmax(z, -1) + torch.logsumexp(lq[cand], -1)
            return out
        if m.markov is None:
            return torch.log_softmax(U[len(path)].float(), -1)
        forced = list(path) + [0]
        _, z, _ = m.markov.decode(U[None, : len(path) + 1], h[None, 1 : len(path) + 2], torch.tensor([ctx[-1]]),
                                  lambda zz, k: torch.tensor([forced[k]]))
        return torch.log_softmax(z[0, len(path)], -1)

    scores = eagle2_scores(logp, depth, TREE_TOPK, None)
    want = best_paths(scores, budget)
    tree = d.propose_tree(ctx, budget, depth)
    assert _tree_paths(tree) == want and len(tree.tokens) == budget
    assert max(map(len, want)) > 1 and len({p[0] for p in want}) > 1  # a real tree: deep and branching
    greedy = tuple(d.propose(ctx, depth).tokens)
    assert greedy[:1] in want  # the chain's first token is the tree's best root child


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_sampled_tree_draws_its_children_without_replacement(trained, tiny, method):
    """At T > 0 each node's children are drawn from q (DSpark's: given the node's token) without replacement, the
    root's from the q the chain draws its first token from; greedy trees carry no rows."""
    m, _ = trained[method]
    feats = torch.randn(7, len(m.cfg.feature_layers) * 32, generator=torch.Generator().manual_seed(4))
    ctx = [5, 6, 7, 8, 9, 10, 11, 12]

    def drafter(params):
        d = DFlashDrafter(m, params)
        d.add_features(feats)
        return d

    first = drafter(SamplingParams(temperature=1.0, seed=1)).propose(ctx, 1).probs[0]
    trees = [drafter(SamplingParams(temperature=1.0, seed=s)).propose_tree(ctx, 7, 3) for s in range(4)]
    for tree in trees:
        assert len(tree.tokens) == 7
        assert_drawn_without_replacement(tree, first)
    assert len({t.tokens for t in trees}) > 1
    assert drafter(GREEDY).propose_tree(ctx, 7, 3).probs is None


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_engine_tree_drafting_equals_hf_with_state_oracle(trained, tiny, tmp_path, method):
    """draft_tree on: greedy output equals HF's, the state oracle passes after every step (the accepted path's
    features are the ones handed on), and drafts get accepted."""
    from verispec import LLM, SamplingParams

    path, hf, _ = tiny
    m, _ = trained[method]
    m.save_pretrained(tmp_path / "ck")
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], [30, 12, 44, 8, 19, 2, 50, 3, 3, 9, 10, 11]]
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2, check_state=True,
              max_num_batched_tokens=16, scheduler="static", progress=False,
              speculative_config={"method": method, "model": str(tmp_path / "ck"), "num_speculative_tokens": 6,
                                  "draft_tree": True})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.token_ids == hf_greedy(hf, p, 20)
        assert o.stats["drafter_error"] is None
    assert max(o.stats["mean_acceptance_length"] for o in outs) > 1.0
    sampled = [SamplingParams(temperature=1.0, seed=i, max_tokens=12, ignore_eos=True) for i in range(3)]
    a, b = (llm.generate([{"prompt_token_ids": p} for p in prompts], sampled, use_tqdm=False) for _ in range(2))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]  # seeded, with the state oracle on throughout
    assert all(o.stats["drafter_error"] is None for o in a)
    assert llm.engine.kv_tokens() == 0


# ---------------------------------------------------------------- DFlash 2's path selector


def _with_selector(m, seed: int = 0, strength: float = 0.5):
    """A copy of the trained DFlash drafter with a random (non-trivial) path selector attached."""
    import copy

    from verispec.drafters.path_selector import PathSelector, SelectorConfig

    m = copy.deepcopy(m)
    torch.manual_seed(seed)
    sel = PathSelector(SelectorConfig(32, 64, m.cfg.block_size - 1, top_m=6, rank=8))
    with torch.no_grad():
        for w in (sel.w_c, sel.w_h, sel.w_l, sel.w_r):
            w.weight.normal_(0.0, strength)
        sel.tap.normal_(0.0, 0.5)
        sel.alpha.uniform_(0.05, 0.2)  # DFlash's own log-probabilities weigh little: the re-ranking shows
    m.selector = sel.eval()
    return m


@torch.no_grad()
def _reference_steps(m, anchor: int, U: torch.Tensor, h: torch.Tensor, path: list[int]) -> list[torch.Tensor]:
    """The selector's step logits over each position's top-m, teacher-forced on `path`, written out from the
    definitions: a_k log q_k(c) + (W_c e_c).(W_h (h_k + t h_{k-1})) + (W_l e_prev).(W_r e_c) / sqrt(r)."""
    sel, E = m.selector, m.parts.embed.float()
    out = []
    U, h = U.clone(), h.clone()  # out of inference mode
    for k, _ in enumerate(path):
        lq = torch.log_softmax(U[k].float(), -1)
        vals, cand = lq.topk(sel.cfg.top_m)
        hk = h[k + 1] + (sel.tap * h[k] if k > 0 else 0.0)
        prev = anchor if k == 0 else path[k - 1]
        z = [sel.alpha[k] * vals[j] + (sel.w_c.weight @ E[c]) @ (sel.w_h.weight @ hk)
             + (sel.w_l.weight @ E[prev]) @ (sel.w_r.weight @ E[c]) / sel.cfg.rank ** 0.5 for j, c in enumerate(cand)]
        out.append((cand, torch.stack(z).detach()))
    return out



def test_selector_walk_follows_its_definition(tiny):
    m = _with_selector(new_model(tiny[2]))  # an untrained DFlash: flat enough for the selector to re-rank
    d = DFlashDrafter(m, GREEDY)
    d.add_features(torch.randn(7, len(m.cfg.feature_layers) * 32, generator=torch.Generator().manual_seed(2)))
    ctx = [5, 6, 7, 8, 9, 10, 11, 12]
    draft = d.propose(ctx, 5)
    h, U = d.block(ctx[-1], 7)
    for k, (cand, z) in enumerate(_reference_steps(m, ctx[-1], U, h, draft.tokens)):
        assert draft.tokens[k] == int(cand[z.argmax()]), f"position {k + 1}"
    plain = [int(t) for t in U[:5].argmax(-1)]
    assert draft.tokens != plain, "a strong selector should leave DFlash's per-position argmax somewhere"
    sampled = DFlashDrafter(m, SamplingParams(temperature=0.7, seed=3))
    sampled.add_features(torch.randn(7, len(m.cfg.feature_layers) * 32, generator=torch.Generator().manual_seed(2)))
    s = sampled.propose(ctx, 5)
    for k, (cand, z) in enumerate(_reference_steps(m, ctx[-1], U, h, s.tokens)):
        q = torch.zeros(64)
        q[cand] = torch.softmax(z / 0.7, -1)
        assert torch.allclose(s.probs[k], q, atol=1e-5) and s.probs[k, s.tokens[k]] > 0


def test_selector_training_lowers_its_loss_and_round_trips(trained, tiny, data_dir, tmp_path):
    from verispec.train.selector import train_selector

    m, _ = trained["dflash"]
    seqs = load_all(data_dir)
    tc = tr.TrainConfig(steps=120, lr=1e-2, warmup=5, eval_every=60, seqs_per_step=4)
    sel, log = train_selector(m, seqs, tc, top_m=6, rank=8, batch=64, anchors_per_seq=16, progress=False)
    first, last = sum(log["loss"][:20]) / 20, sum(log["loss"][-20:]) / 20
    assert last < 0.9 * first, (first, last)
    assert set(log["heldout"][-1]) >= {"acc", "base_acc", "run", "base_run"}
    import copy

    from verispec.drafters.dflash import load

    mm = copy.deepcopy(m)
    mm.selector = sel
    mm.save_pretrained(tmp_path / "ck")
    back = load(tmp_path / "ck", tiny[2])
    assert back.selector is not None and all(torch.equal(a, b) for a, b in zip(
        back.selector.state_dict().values(), sel.state_dict().values()))
    m.save_pretrained(tmp_path / "plain")  # a drafter without a selector writes none and loads none
    assert load(tmp_path / "plain", tiny[2]).selector is None
    dspark, _ = trained["dspark"]
    dspark.save_pretrained(tmp_path / "dspark")
    sel.save(tmp_path / "dspark")
    with pytest.raises(ValueError, match="path selector"):
        load(tmp_path / "dspark", tiny[2])


@pytest.mark.parametrize("tree", [False, True])
def test_engine_with_selector_equals_hf_with_state_oracle(trained, tiny, tmp_path, tree):
    """DFlash 2 in the engine (chains and trees), loaded from a checkpoint with its selector: greedy output equals
    HF's, state oracle after every step."""
    from verispec import LLM, SamplingParams

    path, hf, _ = tiny
    m = _with_selector(trained["dflash"][0], strength=0.2)
    m.save_pretrained(tmp_path / "ck")
    prompts = [[1, 2, 3, 4, 5], [30, 12, 44, 8, 19, 2, 50, 3, 3, 9, 10, 11]]
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2, check_state=True,
              max_num_batched_tokens=16, scheduler="static", progress=False,
              speculative_config={"method": "dflash", "model": str(tmp_path / "ck"), "num_speculative_tokens": 5,
                                  "draft_tree": tree})
    assert llm.drafters.learned.selector is not None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 2, use_tqdm=False)
    for o, p in zip(outs, prompts):
        assert o.token_ids == hf_greedy(hf, p, 16) and o.stats["drafter_error"] is None
    assert llm.engine.kv_tokens() == 0


def test_selector_cli_writes_the_drafter_with_its_selector(trained, tiny, data_dir, tmp_path):
    """`verispec train selector`: the DFlash checkpoint copied with the selector beside it, which then loads."""
    from verispec.cli import main

    m, _ = trained["dflash"]
    m.save_pretrained(tmp_path / "dflash")
    rc = main(["train", "selector", "--drafter", str(tmp_path / "dflash"), "--data", str(data_dir), "--out",
               str(tmp_path / "dflash2"), "--model", tiny[0], "--steps", "3", "--top-m", "4", "--rank", "4",
               "--batch", "16", "--anchors-per-seq", "4"])
    assert rc == 0
    back = load(tmp_path / "dflash2", tiny[2])
    assert back.selector is not None and back.selector.cfg.top_m == 4
    assert json.loads((tmp_path / "dflash2" / "path_selector.json").read_text())["heldout"]["step"] == 3
    assert load(tmp_path / "dflash", tiny[2]).selector is None  # the source stays as it was


def test_selector_cli_max_sequences_trains_on_a_seeded_subset(trained, tiny, data_dir, tmp_path, capsys,
                                                                 monkeypatch):
    """--max-sequences N: N distinct sequences of the data, in data order, the same N on every run; bad values are
    refused with a message."""
    from verispec.cli import main
    from verispec.train.selector import subset

    seqs = load_all(data_dir)
    a, b = subset(seqs, 6), subset(seqs, 6)
    pos = [next(i for i, s in enumerate(seqs) if s is q) for q in a]
    assert len(a) == 6 and pos == sorted(set(pos)) and [id(q) for q in a] == [id(q) for q in b]
    assert subset(seqs, None) is seqs and subset(seqs, len(seqs) + 5) is seqs
    trained["dflash"][0].save_pretrained(tmp_path / "dflash")
    args = ["train", "selector", "--drafter", str(tmp_path / "dflash"), "--data", str(data_dir), "--out",
            str(tmp_path / "sel"), "--model", tiny[0], "--steps", "2", "--top-m", "4", "--rank", "4", "--batch", "16",
            "--anchors-per-seq", "4"]
    from verispec.train import shards, share

    refs = subset(share.catalog(data_dir), 6)  # the CLI reads only these from the shards, never the whole set
    assert [torch.equal(q.ids, r.ids) for q, r in zip(a, share.load(data_dir, refs, []))] == [True] * 6

    def whole_set(*_):
        raise AssertionError("the whole data set was loaded")

    monkeypatch.setattr(shards, "load_all", whole_set)
    assert main(args + ["--max-sequences", "6"]) == 0
    log = json.loads((tmp_path / "sel" / "selector_log.json").read_text())
    assert log["sequences"] == 6 and log["train_anchors"] + log["heldout_anchors"] <= 6 * 4
    for bad in ("1", "x"):
        with pytest.raises(SystemExit):
            main(args + ["--max-sequences", bad])
        assert "--max-sequences must be" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_q8_0_drafter_drafts_like_the_float_one_and_stays_lossless(trained, tiny, tmp_path, method):
    """`quantize_q8act` (the drafter beside a gguf-q8act target): every linear on the kernel with int8 activations
    stays within 2% of the float product, the logits through the target's Q8_0 head mostly agree on the top token,
    the drafter refuses to be saved, `load` rounds it only beside a target that runs the kernel, and the engine's
    greedy output still equals HF's with the state oracle on (the context K/V is recomputed by the same layers)."""
    import copy

    from verispec import LLM, SamplingParams
    from verispec.drafters.dflash_model import LAYER_LINEARS
    from verispec.drafters.dspark_head import MarkovHead
    from verispec.kernels.q8act import Q8ActWeight

    path, hf, target = tiny
    dense = trained[method][0]
    rounded = copy.deepcopy(dense)
    rounded.quantize_q8act(Q8ActWeight.from_float(target.output_weight()))
    g = torch.Generator().manual_seed(5)
    pairs = [(dense.fc, rounded.fc)] + [(getattr(a, n), getattr(b, n)) for a, b in zip(dense.layers, rounded.layers)
                                         for n in LAYER_LINEARS]
    for a, b in pairs:
        assert isinstance(b, Q8ActWeight)
        x = torch.randn(5, a.weight.shape[1], generator=g)
        want = x @ a.weight.t()
        assert (b(x) - want).norm() < 0.02 * want.norm()
    h = torch.randn(200, 32, generator=g)
    assert (dense.logits(h).argmax(-1) == rounded.logits(h).argmax(-1)).float().mean() >= 0.9
    with pytest.raises(ValueError, match="Q8_0"):
        rounded.save_pretrained(tmp_path / "never")
    markov = MarkovHead(64, 32, 32)  # a rank the blocks fit (the tiny drafter's 16 stays float)
    torch.nn.init.normal_(markov.w2.weight, std=0.1, generator=g)
    prev = torch.tensor([3, 9, 60])
    want = markov.bias(prev)
    markov.w2 = Q8ActWeight.from_float(markov.w2.weight)
    assert (markov.bias(prev) - want).norm() < 0.02 * want.norm() and markov.bias(prev[0]).shape == (64,)

    dense.save_pretrained(tmp_path / "ck")
    assert not load(tmp_path / "ck", target).quantized  # a dense target: the float drafter
    spec = {"method": method, "model": str(tmp_path / "ck"), "num_speculative_tokens": 5}
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2, check_state=True,
              max_num_batched_tokens=8, scheduler="static", progress=False, speculative_config=spec)
    llm.model.decoder_kernel, llm.model.head_weight = object(), Q8ActWeight.from_float(llm.model.output_weight())
    q = load(tmp_path / "ck", llm.model)  # beside a target on the kernel: rounded, logits through its head
    assert q.quantized and q.parts.out_head is llm.model.head_weight
    llm.model.decoder_kernel, llm.model.head_weight = None, None
    llm.drafters.learned.quantize_q8act(q.parts.out_head)
    prompts = [[1, 2, 3, 4, 5], [7, 7, 7], [30, 12, 44, 8, 19, 2, 50, 3, 3, 9, 10, 11]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 3, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 20)
    assert max(o.stats["mean_acceptance_length"] for o in outs) > 1.0, "the rounded drafter still gets drafts accepted"


@pytest.mark.parametrize("method, kind", [("dflash", "Q8_0"), ("dspark", "Q8_0"), ("dspark", "Q4_0")])
def test_the_kernel_block_computes_the_drafters_layers(trained, tiny, method, kind):
    """Beside a gguf-q8act target the rounded drafter runs its layers through a few kernel calls
    (drafters/dflash_kernel.py: q | k | v and gate | up stacked, norms, residuals and SwiGLU fused, vs_attention, the
    context K/V of every layer in two linears). Against the same rounded drafter's torch ops (separate weights, torch
    norms, RoPE and attention): the context K/V and the block's hidden states agree to the rounding of the int8
    activations, the kernel keeps the context rows of the buffers untouched, and a drafter's block (context arriving
    in two chunks, K/V buffers grown on the way) equals the torch block of the same rounded drafter."""
    import copy

    from verispec.kernels.q8act import Q8ActWeight

    _, _, target = tiny
    m = copy.deepcopy(trained[method][0])
    m.quantize_q8act(Q8ActWeight.from_float(target.output_weight()), kind)
    kern, c = m.kernel, m.cfg
    assert kern is not None and kern.ctx_kv.kind == m.fc.kind == m.layers[0].o_proj.kind == kind
    g = torch.Generator().manual_seed(7)
    n, B = 40, c.block_size
    feats = torch.randn(n, len(c.feature_layers) * c.hidden_size, generator=g)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).detach().norm() / b.detach().norm())

    with torch.no_grad():
        got = kern.context_kv(feats, torch.arange(n))
        m.kernel = None  # the torch ops over the same rounded weights
        want = m.context_kv(feats, torch.arange(n))
        x = m.block_inputs(torch.tensor([5]))[0]
        ref = m.block_hidden(x, torch.arange(n, n + B), want, None)
        m.kernel = kern
    for (k, v), (rk, rv) in zip(got, want):
        assert rel(k, rk) < 1e-3 and rel(v, rv) < 1e-3
    kb = [torch.cat([k, torch.zeros(B, *k.shape[1:])]) for k, _ in got]
    vb = [torch.cat([v, torch.zeros(B, *v.shape[1:])]) for _, v in got]
    before = [t[:n].clone() for t in kb + vb]
    h = kern.block_hidden(x, torch.arange(n, n + B), kb, vb, n)
    assert rel(h, ref) < 2e-3
    assert all(torch.equal(t[:n], b) for t, b in zip(kb + vb, before)), "the context rows were written"
    d = DFlashDrafter(m, GREEDY)
    d.add_features(feats[:3])
    d.add_features(feats[3:])
    dh, dU = d.block(5, n)
    assert d._k[0].shape[0] >= n + B and rel(dh, ref) < 2e-3
    assert (dU.argmax(-1) == m.logits(ref[1:]).argmax(-1)).float().mean() >= 0.8
    d.check_state(feats)  # the cached context K/V are what the kernel recomputes from the features, exactly


@pytest.mark.parametrize("method", ["dflash", "dspark"])
def test_a_draft_vocabulary_limits_the_drafts_and_stays_lossless(trained, tiny, data_dir, tmp_path, method,
                                                                  capsys):
    """`verispec train draft-vocab` stores the N most frequent response tokens of the data (counted here from the
    loaded sequences); `load` for inference restricts the drafter's logits to them (the target's own logits at those
    tokens, -inf elsewhere; training and export loads keep the whole vocabulary); greedy drafts are the argmax
    over the draft tokens of the logits (DSpark: corrected by B_k, left to right); the engine's greedy output still
    equals HF's with the state oracle on; bad checkpoints and sizes are refused."""
    import torch.nn.functional as F

    from verispec import LLM, SamplingParams
    from verispec.cli import main
    from verispec.drafters import draft_vocab

    path, hf, target = tiny
    dense = trained[method][0]
    ck = tmp_path / "ck"
    dense.save_pretrained(ck)
    assert main(["train", "draft-vocab", str(ck), "--data", str(data_dir), "--size", "20"]) == 0
    assert "20 of 64 tokens" in capsys.readouterr().out
    counts = torch.zeros(64, dtype=torch.long)
    for seq in load_all(data_dir):
        counts += torch.bincount(seq.ids[seq.prompt_len :], minlength=64)
    want = sorted(sorted(range(64), key=lambda t: (-int(counts[t]), t))[:20])
    ids = draft_vocab.read(ck)
    assert ids.tolist() == want
    assert load(ck, target, inference=False).vocab is None
    m = load(ck, target)
    assert m.vocab is not None
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        h = torch.randn(5, 32, generator=g)
        U, ref = m.logits(h), F.linear(h, target.output_weight())
        outside = torch.ones(64, dtype=torch.bool)
        outside[ids] = False
        assert torch.allclose(U[:, ids], ref[:, ids], atol=1e-5) and bool(torch.isinf(U[:, outside]).all())
        d = DFlashDrafter(m, GREEDY)
        d.add_features(torch.randn(9, len(m.cfg.feature_layers) * 32, generator=g))
        ctx = list(range(3, 13))
        draft = d.propose(ctx, 7).tokens
        hb, Ub = d.block(ctx[-1], 9)
        prev, expect = ctx[-1], []
        for k in range(7):
            z = Ub[k, ids] + (m.markov.bias(torch.tensor(prev))[ids] if m.markov is not None else 0)
            prev = int(ids[int(z.argmax())])
            expect.append(prev)
        assert draft == expect and set(draft) <= set(want)
    spec = {"method": method, "model": str(ck), "num_speculative_tokens": 5}
    llm = LLM(path, dtype="float32", device="cpu", max_model_len=64, max_num_seqs=2, check_state=True,
              max_num_batched_tokens=8, scheduler="static", progress=False, speculative_config=spec)
    assert llm.drafters.learned.vocab is not None
    prompts = [[1, 2, 3, 4, 5], [30, 12, 44, 8, 19, 2, 50, 3, 3, 9, 10, 11]]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2, use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 20)
    for bad in (["--size", "0"], ["--size", "65"]):
        with pytest.raises(SystemExit, match="--size"):
            main(["train", "draft-vocab", str(ck), "--data", str(data_dir), *bad])
    with pytest.raises(SystemExit, match="not a DFlash"):
        main(["train", "draft-vocab", str(tmp_path), "--data", str(data_dir)])


def _train(data_dir, method, out, *extra) -> dict:
    """`verispec train dflash|dspark --quick --out OUT ...` on the test data, in process (DSpark with a Markov rank
    of 8)."""
    import argparse

    p = argparse.ArgumentParser()
    tr.add_args(p, method)
    rank = ["--markov-rank", "8"] if method == "dspark" else []
    args = ["--data", str(data_dir), "--device", "cpu", "--quick", "--out", str(out), *rank, *map(str, extra)]
    return tr.run(p.parse_args(args), method)


def test_init_continues_from_a_trained_drafter_and_refuses_another_shape(tiny, data_dir, tmp_path):
    """--init: the run starts where the given drafter ended (its held-out metrics before the first update are the
    trained drafter's after its last), keeps its shape, and refuses another method or block size."""
    from dataclasses import replace

    first = _train(data_dir, "dspark", tmp_path / "a", "--steps", "6", "--block-size", "4")
    more = _train(data_dir, "dspark", tmp_path / "b", "--steps", "2", "--block-size", "4", "--init", tmp_path / "a")
    want, got = first["heldout"][-1], more["heldout"][0]
    assert got["step"] == 0 and all(abs(got[k] - want[k]) < 1e-5 for k in want if k != "step"), (got, want)
    shape = lambda c: replace(c, confidence_temperatures=())  # noqa: E731 (calibrated again after the run)
    assert shape(load(tmp_path / "b", tiny[2]).cfg) == shape(load(tmp_path / "a", tiny[2]).cfg)
    with pytest.raises(ValueError, match="dspark True"):
        _train(data_dir, "dflash", tmp_path / "c", "--steps", "1", "--block-size", "4", "--init", tmp_path / "a")
    with pytest.raises(ValueError, match="block_size 4"):
        _train(data_dir, "dspark", tmp_path / "d", "--steps", "1", "--block-size", "8", "--init", tmp_path / "a")


def test_dspark_init_from_a_dflash_drafter_starts_as_that_drafter(tiny, data_dir, tmp_path):
    """`train dspark --init DFLASH`: the backbone is the DFlash drafter's and the Markov head starts at B = 0, so
    before the first update its held-out accuracy and tau are the DFlash run's after its last (computed there by the
    DFlash loss, here through the Markov correction); its drafts are those of the DFlash drafter."""
    first = _train(data_dir, "dflash", tmp_path / "a", "--steps", "6", "--block-size", "4")
    more = _train(data_dir, "dspark", tmp_path / "b", "--steps", "2", "--block-size", "4", "--init", tmp_path / "a")
    want, got = first["heldout"][-1], more["heldout"][0]
    assert got["step"] == 0 and all(abs(got[k] - want[k]) < 1e-5 for k in ("acc", "tau")), (got, want)
    assert more["heldout"][-1]["step"] > 0 and "bce" in got
    a, b = load(tmp_path / "a", tiny[2]), load(tmp_path / "b", tiny[2])
    assert b.cfg.dspark and b.cfg.markov_rank == 8 and b.cfg.block_size == a.cfg.block_size
    with pytest.raises(ValueError, match="block_size 4"):
        _train(data_dir, "dspark", tmp_path / "c", "--steps", "1", "--block-size", "8", "--init", tmp_path / "a")
