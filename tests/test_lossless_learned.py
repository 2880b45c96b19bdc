"""Sampling with the learned drafters follows the target's exact sequence distribution (closed form, chi-square).

EAGLE-3 (whose reduced draft vocabulary leaves one target token undraftable) and DSpark (Markov head sampled left
to right) with random weights, so q != p; 10,000 seeded 3-token continuations, 16 requests decoding together."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (N, batched_counts, chi2_pvalue, exact_distribution, random_dspark,
                           random_eagle3_head, tiny_vocab_model)
from verispec import LLM
from verispec.models.loader import load_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("learned-dist")
    hf = tiny_vocab_model(d, 0, 40.0)
    model, _ = load_model(str(d), dtype="float32", device="cpu", progress=False)
    return hf, d, model


@pytest.mark.parametrize("method, tree", [("eagle3", False), ("dspark", False), ("eagle3", True), ("dspark", True)])
def test_learned_drafter_sampling_matches_exact_distribution(target, tmp_path, method, tree, monkeypatch):
    """Chains, and trees whose children are drawn without replacement. Trees over 4-token continuations: the first
    comes from the prefill and a step drafts at most what is left but one, so 3 tokens left allow 2 nodes (siblings
    or a chain) where a 3-token continuation allows a single node."""
    import verispec.engine.core as core

    hf, d, model = target
    shapes, real = [], core.verify_tree
    monkeypatch.setattr(core, "verify_tree", lambda t, *a: shapes.append(
        (t.probs is not None, len(set(t.parents)) < len(t.parents))) or real(t, *a))
    (random_eagle3_head if method == "eagle3" else random_dspark)(model, tmp_path / method)
    spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 3 if tree else 2,
            "adaptive": False, "draft_tree": tree}
    llm = LLM(str(d), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=16, scheduler="static",
              progress=False)
    length = 4 if tree else 3
    counts, outs = batched_counts(llm, N // 2, length=length)
    assert not any(o.stats["lossy"] for o in outs)
    drafted = sum(o.stats["num_draft_tokens"] for o in outs)
    accepted = sum(o.stats["num_accepted_tokens"] for o in outs)
    rate = accepted / drafted
    assert 0.1 < rate < 0.95, f"acceptance {rate:.2f}: the drafter must differ from the target and be accepted sometimes"
    if tree:  # every tree carries its drawn rows, and some branch
        assert shapes and all(rows for rows, _ in shapes) and any(branching for _, branching in shapes)
    pval = chi2_pvalue(counts, exact_distribution(hf, length))
    assert pval > 1e-3, f"{method}: speculative samples do not follow the target distribution (p = {pval:.2e})"
