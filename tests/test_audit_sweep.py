"""`verispec audit sweep` and the drift it measures (execution/drift.py).

Oracles: closed forms of the applied distribution (the exact rule gives the target's; hand-computed threshold and
typical cases), Monte-Carlo sampling through `verify_sampled` (chi-square against the computed applied distribution,
and against the target to show the test has power), an argmax-prefix reference for greedy verification, and the
engine on a tiny-vocabulary target with a different draft model (TV grows as the threshold falls, the exact
threshold reproduces exact verification token for token).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers import PROMPT, chi2_pvalue, tiny_vocab_model
from verispec.execution.drift import acceptance_probs, applied_distribution, position_tv
from verispec.sampling import SamplingParams
from verispec.execution.verify import EXACT, AcceptanceConfig, verify, verify_sampled

THRESH = AcceptanceConfig("threshold", threshold_single=1.0, threshold_acc=0.5)


# ---- the pure drift functions against closed forms ------------------------------------------------------------------

@pytest.mark.parametrize("vocab", [2, 7, 300])
def test_exact_rule_applies_the_target_distribution(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    p = (3 * torch.randn(8, vocab, generator=g)).softmax(-1)  # [8, V]
    q = (3 * torch.randn(8, vocab, generator=g)).softmax(-1)
    draft = torch.randint(vocab, (8,), generator=g)
    for rule in (EXACT, AcceptanceConfig("threshold", 1.0, 1.0)):  # the threshold rule at 1 is the exact rule
        assert position_tv(p, q, draft, rule).max() < 1e-6
        assert position_tv(p, None, draft, rule).max() < 1e-6  # a deterministic drafter: q = one-hot(x)
    assert position_tv(p, q, draft, THRESH).min() > 0  # a relaxed rule moves it


def test_threshold_and_typical_on_hand_made_distributions() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64)
    x = torch.tensor([1])
    # one-hot draft x=1, threshold_acc 0.5: accept with 0.3 / 0.5 = 0.6, else p without x renormalised
    # applied = [0.4 * 5/7, 0.6, 0.4 * 2/7]; TV = 0.6 - 0.3
    assert float(position_tv(p, None, x, THRESH)[0]) == pytest.approx(0.3, abs=1e-12)
    # threshold_single 0.25: p(x) = 0.3 >= 0.25, always accepted -> applied = one-hot(1); TV = 1 - 0.3
    single = AcceptanceConfig("threshold", threshold_single=0.25)
    assert float(position_tv(p, None, x, single)[0]) == pytest.approx(0.7, abs=1e-12)
    # typical: H(p) = 1.0297 nats, bar = min(0.3, 0.09 e^-H) = 0.0321 < 0.3: x always accepted; TV = 0.7
    assert float(position_tv(p, None, x, AcceptanceConfig("typical"))[0]) == pytest.approx(0.7, abs=1e-12)
    # a full draft distribution: a = min(1, p / (0.5 q)) = [1, 1, 0.4]; sum q a = 0.7; residual = one-hot(0)
    # applied = [0.2 + 0.3, 0.3, 0.5 * 0.4] = [0.5, 0.3, 0.2]; TV = 0.1
    p2 = torch.tensor([[0.6, 0.3, 0.1]], dtype=torch.float64)
    q2 = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    assert applied_distribution(p2, q2, THRESH)[0].tolist() == pytest.approx([0.5, 0.3, 0.2], abs=1e-12)
    assert float(position_tv(p2, q2, x, THRESH)[0]) == pytest.approx(0.1, abs=1e-12)


@pytest.mark.parametrize("rule", [EXACT, THRESH, AcceptanceConfig("threshold", 0.3, 0.6), AcceptanceConfig("typical")])
def test_deterministic_drafter_shortcut_equals_the_general_formula(rule: AcceptanceConfig) -> None:
    """q = None (one-hot at the draft token) takes an O(1) path; it must equal the [V] formula with q one-hot."""
    g = torch.Generator().manual_seed(11)
    p = (2 * torch.randn(32, 9, generator=g)).double().softmax(-1)  # [32, V], sums to 1 in float64
    p[0] = torch.nn.functional.one_hot(torch.tensor(4), 9).double()  # p(x) = 1
    draft = torch.randint(9, (32,), generator=g)
    draft[0] = 4
    one_hot = torch.nn.functional.one_hot(draft, 9).double()  # [32, V]
    want = 0.5 * (applied_distribution(p, one_hot, rule) - p).abs().sum(-1)
    assert torch.allclose(position_tv(p, None, draft, rule), want, atol=1e-12)


def test_tv_grows_as_the_threshold_falls_on_random_distributions() -> None:
    g = torch.Generator().manual_seed(3)
    p = (2 * torch.randn(64, 20, generator=g)).softmax(-1)
    q = (2 * torch.randn(64, 20, generator=g)).softmax(-1)
    draft = torch.zeros(64, dtype=torch.long)
    tv = [float(position_tv(p, q, draft, AcceptanceConfig("threshold", 1.0, c)).mean()) for c in (1.0, 0.8, 0.5, 0.2)]
    assert tv[0] < 1e-6 and all(b > a for a, b in zip(tv, tv[1:])), tv


TYPICAL = AcceptanceConfig("typical", typical_epsilon=0.25, typical_delta=0.5)


@pytest.mark.parametrize("rule,one_hot", [(THRESH, False), (THRESH, True), (TYPICAL, False)])
def test_sampling_with_the_rule_has_the_computed_distribution(rule: AcceptanceConfig, one_hot: bool) -> None:
    """x ~ q, then verify_sampled with one draft token: the emitted token follows applied(p, q, rule), not p; the
    mean of `relaxed` is P(the rule accepts and the exact test, on the same uniform, rejects)."""
    p = torch.tensor([[0.45, 0.25, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])  # [2, V]: position 1 and the bonus
    q = torch.tensor([[0.1, 0.5, 0.1, 0.3]])  # [1, V]
    if one_hot:
        q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])
    gen = torch.Generator().manual_seed(0)
    n, counts, relaxed = 3000, torch.zeros(4), 0
    draws = torch.multinomial(q[0], n, replacement=True, generator=torch.Generator().manual_seed(1))
    for x in draws.tolist():
        v = verify_sampled(torch.tensor([x]), None if one_hot else q, p, gen, rule)
        counts[v.tokens[0]] += 1
        relaxed += v.relaxed
    applied = applied_distribution(p[:1].double(), q.double(), rule)[0].float()
    assert chi2_pvalue(counts, applied) > 1e-3
    assert chi2_pvalue(counts, p[0]) < 1e-6  # the test can tell the rule from the target
    a_rule = acceptance_probs(p[:1].double(), q.double(), rule)[0]
    a_exact = acceptance_probs(p[:1].double(), q.double(), EXACT)[0]
    # threshold: its acceptance event contains the exact one (same uniform); typical's does not depend on u
    favoured = a_rule * (1 - a_exact) if rule.rule == "typical" else a_rule - a_exact
    want = float((q[0].double() * favoured).sum())
    assert relaxed / n == pytest.approx(want, abs=4 * (want / n) ** 0.5 + 1e-9)


def test_greedy_verification_ignores_the_rule() -> None:
    """Temperature 0: the verdict is the argmax prefix, whatever the rule, and no drift is reported."""
    g = torch.Generator().manual_seed(5)
    rules = (EXACT, AcceptanceConfig("threshold", 0.1, 0.1), AcceptanceConfig("typical"))
    for trial in range(50):
        logits = torch.randn(5, 6, generator=g)  # [g + 1, V]
        best = logits.argmax(-1).tolist()
        draft = [best[i] if torch.rand(1, generator=g) < 0.7 else (best[i] + 1) % 6 for i in range(4)]
        n = next((i for i in range(4) if draft[i] != best[i]), 4)
        want = draft[:n] + [best[n]]
        for rule in rules:
            v = verify(draft, None, logits, SamplingParams(temperature=0.0), None, rule)
            assert (v.accepted, v.tokens, v.relaxed, v.tv_positions) == (n, want, 0, 0), (trial, rule)


# ---- the engine on a tiny-vocabulary target with a different draft model -------------------------------------------

@pytest.fixture(scope="module")
def vocab_models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("sweep-target"), tmp_path_factory.mktemp("sweep-draft")
    tiny_vocab_model(target_dir, 0, 40.0)
    tiny_vocab_model(draft_dir, 1, 40.0)
    return target_dir, draft_dir


def _outputs(llm, temperature: float, n: int = 32) -> list:
    from verispec import SamplingParams as SP

    params = [SP(temperature=temperature, max_tokens=12, seed=s, ignore_eos=True) for s in range(n)]
    return llm.generate([{"prompt_token_ids": PROMPT}] * n, params, use_tqdm=False)


def test_engine_drift_grows_as_the_threshold_falls(vocab_models) -> None:
    from verispec import LLM

    target_dir, draft_dir = vocab_models
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2, "adaptive": False}
    base = LLM(str(target_dir), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=16,
               progress=False)
    exact_hot, exact_greedy = _outputs(base, 1.0), _outputs(base, 0.0)
    assert all(o.stats["tv_positions"] == 0 and o.stats["tv_mean"] is None for o in exact_hot)  # exact: not measured
    tvs, shares = [0.0], [0.0]  # the threshold rule at 1 is the exact rule: no drift, nothing relaxed
    for c in (1.0, 0.7, 0.4, 0.1):
        llm = base.with_speculation({**spec, "acceptance_rule": "threshold", "threshold_acc": c})
        hot = _outputs(llm, 1.0)
        assert [o.token_ids for o in _outputs(llm, 0.0)] == [o.token_ids for o in exact_greedy]  # greedy: identical
        if c == 1.0:  # the exact rule (the seeded race): the same tokens for the same seeds, no drift measured
            assert [o.token_ids for o in hot] == [o.token_ids for o in exact_hot]
            assert all(o.stats["tv_positions"] == 0 and o.stats["num_relaxed_accepted_tokens"] == 0 for o in hot)
            continue
        acc = sum(o.stats["num_accepted_tokens"] for o in hot)
        pos = sum(o.stats["tv_positions"] for o in hot)
        assert acc > 0 and pos > 100  # drafts were proposed, verified and accepted
        tvs.append(sum(o.stats["tv_mean"] * o.stats["tv_positions"] for o in hot if o.stats["tv_positions"]) / pos)
        shares.append(sum(o.stats["num_relaxed_accepted_tokens"] for o in hot) / acc)
    assert all(b > a for a, b in zip(tvs, tvs[1:])), tvs
    assert all(b > a for a, b in zip(shares, shares[1:])), shares


# ---- the command end to end on the tiny Llama with the default tokenizer -------------------------------------------

def _length_grader(item, output: str):
    from verispec.audit.graders import Grade

    score = min(1.0, len(output) / 40)
    return Grade(score, score >= 0.5, {"chars": len(output)})


def test_sweep_values_are_checked() -> None:
    from verispec.audit.spec import EngineSpec
    from verispec.audit.sweep import parse_values, value_spec

    assert parse_values("0.4,1.0,0.8,0.8") == [1.0, 0.8, 0.4]
    for bad in ("", "0,1", "1.5", "a"):
        with pytest.raises(ValueError, match="--values"):
            parse_values(bad)
    s = value_spec(EngineSpec(method="ngram"), "threshold", "both", 0.6)
    assert (s.rule, s.threshold_acc, s.threshold_single, s.lossy) == ("threshold", 0.6, 0.6, True)
    with pytest.raises(ValueError, match="supports threshold"):
        value_spec(EngineSpec(method="ngram"), "typical", "threshold_acc", 0.6)


def test_cli_sweep_end_to_end(tiny_dir: Path, tmp_path: Path, monkeypatch, capsys) -> None:
    import verispec.audit.graders as graders
    from verispec.cli import main

    monkeypatch.setattr(graders, "grade", _length_grader)
    path = tmp_path / "items.jsonl"
    path.write_text("".join(json.dumps({"id": f"t{i}", "domain": "creative" if i % 2 else "coding",
                                        "messages": [{"role": "user", "content": f"Two lines about {w}."}],
                                        "max_tokens": 24, "check": {}}) + "\n"
                            for i, w in enumerate(["caches", "owls", "salt", "maps"])))
    out = tmp_path / "sweep"
    rc = main(["audit", "sweep", "--rule", "threshold", "--values", "1.0,0.5,0.2", "--temperature", "0,1",
               "--samples", "2", "--items", str(path), "--model", str(tiny_dir), "--dtype", "float32", "--k", "3",
               "--method", "draft_model", "--drafter", str(tiny_dir),  # q = p: drafts proposed and accepted
               "--max-num-seqs", "4", "--bootstrap", "200", "--quiet", "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "T=0: every value is byte-identical" in printed
    data = json.loads((out / "sweep.json").read_text())
    recs = [r for r in data["records"] if r["side"] != "run"]
    assert len(recs) == 4 * (4 + 8)  # the reference and three values, 4 greedy + 8 sampled jobs each
    greedy = {}
    for r in recs:
        if r["temperature"] == 0:
            greedy.setdefault(r["item_id"], set()).add(tuple(r["token_ids"]))
    assert all(len(v) == 1 for v in greedy.values())  # every value's greedy tokens are the reference's
    rows = data["tables"][0]["rows"]
    assert len(rows) == 2 * 4 and {r["byte-identical"] for r in rows if r["T"] == 0} == {"yes"}
    assert all(r["byte-identical"] == "yes" for r in rows if r["threshold_acc"].startswith("1"))  # 1.0 == exact
    # the lossy values (1.0 is the exact rule, the seeded race, whose drift is not measured: it has none)
    hot = [r for r in rows if r["T"] == 1 and not r["threshold_acc"].startswith("1")]
    assert len(hot) == 2 and all(float(r["tau"]) > 1.5 and r["TV positions"] > 0 for r in hot)
    assert all(float(r["TV mean"]) < 1e-6 for r in hot)  # q = p: every rule applies p
    assert {p.name for p in out.iterdir()} >= {"sweep.json", "sweep.csv", "sweep.md", "sweep.html",
                                                "sweep_tau_delta.png"}
    md = (out / "sweep.md").read_text()
    assert all(f"**{c}**" in md for c in ("concurrency", "metric", "baseline"))
    assert main(["audit", "sweep", "--values", "0,2", "--out", str(out)]) == 2
    assert "--values needs numbers in (0, 1]" in capsys.readouterr().err
    assert main(["audit", "--reference", "plain", "--out", str(out)]) == 2
    assert "needs --candidate" in capsys.readouterr().err
