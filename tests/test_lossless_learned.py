"""Sampling with the learned drafters follows the target's exact sequence distribution (closed form, chi-square).

EAGLE-3 (whose reduced draft vocabulary leaves one target token undraftable) and DSpark (Markov head sampled left
to right) with random weights, so q != p; 10,000 seeded 3-token continuations, 16 requests decoding together."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import N, batched_counts, chi2_pvalue, exact_distribution, tiny_vocab_model
from verispec import LLM
from verispec.models.loader import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("learned-dist")
    hf = tiny_vocab_model(d, 0, 40.0)
    model, _ = load_model(str(d), dtype="float32", device="cpu", progress=False)
    return hf, d, model


def _eagle3(model, out):
    from verispec.drafters.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(11)
    head = Eagle3Head(Eagle3Config.for_target(model, (0, 1), draft_vocab_size=4), model)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)  # near-uniform q: accepted often enough, still != p
        head.d2t.copy_(torch.tensor([0, 0, 1, 1]))  # draft ids 0..3 -> target ids 0, 1, 3, 4: token 2 undraftable
        head.t2d[torch.tensor([0, 1, 3, 4])] = True
    head.save_pretrained(out)


def _dspark(model, out):
    from verispec.drafters.dflash_model import DFlashConfig, DFlashModel, TargetParts

    torch.manual_seed(12)
    cfg = DFlashConfig.for_target(model.cfg, num_layers=1, block_size=4, target_layer_ids=(0,), dspark=True,
                                  markov_rank=4)
    m = DFlashModel(cfg, TargetParts.of(model))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.1)  # near-uniform q: accepted often enough, still != p
    m.save_pretrained(out)


@pytest.mark.parametrize("method", ["eagle3", "dspark"])
def test_learned_drafter_sampling_matches_exact_distribution(target, tmp_path, method):
    hf, d, model = target
    (_eagle3 if method == "eagle3" else _dspark)(model, tmp_path / method)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(str(d), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=16, scheduler="static",
              progress=False)
    counts, outs = batched_counts(llm, N // 2)
    assert not any(o.stats["lossy"] for o in outs)
    drafted = sum(o.stats["num_draft_tokens"] for o in outs)
    accepted = sum(o.stats["num_accepted_tokens"] for o in outs)
    rate = accepted / drafted
    assert 0.1 < rate < 0.95, f"acceptance {rate:.2f}: the drafter must differ from the target and be accepted sometimes"
    pval = chi2_pvalue(counts, exact_distribution(hf))
    assert pval > 1e-3, f"{method}: speculative samples do not follow the target distribution (p = {pval:.2e})"
