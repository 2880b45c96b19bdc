"""Sampling with speculation follows the target's exact sequence distribution (closed form, chi-square).

A tiny-vocabulary target and a different draft model (q != p), 20,000 seeded continuations of 3 tokens, compared
with P(x1 x2 x3 | prompt) computed from HF transformers' forward over all V^3 continuations. The same test must
reject a lossy acceptance threshold (negative control).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (LENGTH, N, PROMPT, V, batched_counts, chi2_pvalue, continuation_index, exact_distribution,
                           tiny_vocab_model)
from verispec import LLM, SamplingParams
from verispec.engine.costs import CostTable, StepCosts
from verispec.engine.scheduler import DSparkPolicy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("dist-target"), tmp_path_factory.mktemp("dist-draft")
    target = tiny_vocab_model(target_dir, 0, 40.0)
    tiny_vocab_model(draft_dir, 1, 40.0)
    return target, (target_dir, draft_dir)


def sample_counts(llm: LLM, n: int = N) -> tuple[torch.Tensor, float, bool]:
    """Counts per continuation over n seeds, the overall acceptance rate, and whether any result was labelled lossy."""
    counts = torch.zeros(V**LENGTH)
    drafted = accepted = 0
    lossy = False
    for seed in range(n):
        out = llm.generate({"prompt_token_ids": PROMPT},
                           SamplingParams(temperature=1.0, max_tokens=LENGTH, seed=seed, ignore_eos=True),
                           use_tqdm=False)[0]
        counts[continuation_index(out.token_ids)] += 1
        drafted += out.stats["num_draft_tokens"]
        accepted += out.stats["num_accepted_tokens"]
        lossy |= out.stats["lossy"]
    return counts, accepted / drafted, lossy


def _llm(dirs, **rule):
    target_dir, draft_dir = dirs
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2, "adaptive": False}
    spec.update(rule)
    return LLM(str(target_dir), dtype="float32", device="cpu", speculative_config=spec)


def test_speculative_sampling_matches_exact_distribution(models):
    hf, base = models
    llm = _llm(base)
    counts, rate, lossy = sample_counts(llm)
    pval = chi2_pvalue(counts, exact_distribution(hf))
    assert 0.2 < rate < 0.95, "the draft must differ from the target, and be accepted sometimes, for this test to mean anything"
    assert not lossy
    assert pval > 1e-3, f"speculative samples do not follow the target distribution (p = {pval:.2e})"


def test_negative_control_lossy_threshold_is_rejected(models):
    """A tenth of the samples (CI time) is ample: at 2,000 the lossy rule's p-value is far below the bound."""
    hf, base = models
    llm = _llm(base, acceptance_rule="threshold", threshold_single=0.05)
    counts, _, lossy = sample_counts(llm, N // 10)
    assert lossy
    assert chi2_pvalue(counts, exact_distribution(hf)) < 1e-3


def test_concurrent_requests_under_dspark_match_exact_distribution(models):
    """Sixteen requests decode together; the DSpark scheduler trims drafts from pre-verification estimates only.

    10,000 samples (half the single-stream test's, for CI time): still enough to reject the lossy control above.
    """
    hf, (target_dir, draft_dir) = models
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}
    llm = LLM(str(target_dir), dtype="float32", device="cpu", speculative_config=spec, max_num_seqs=16,
              scheduler="dspark")
    # a fixed cost table (each verified token costs 1% of a one-token step), not the machine's measured one:
    # whether dspark verifies and trims drafts here must not depend on how busy the machine is
    llm.engine.policy = DSparkPolicy(StepCosts(CostTable((1, 100), (1.0, 1.0 + 0.01 * 99))))
    counts, outs = batched_counts(llm, N // 2)
    drafted = sum(o.stats["num_draft_tokens"] for o in outs)
    verified_steps = sum(o.stats["steps"] for o in outs)
    assert 0 < drafted < 2 * verified_steps, "the scheduler must verify drafts, and trim some, for this test to mean anything"
    pval = chi2_pvalue(counts, exact_distribution(hf))
    assert pval > 1e-3, f"batched speculative samples under dspark do not follow the target distribution (p = {pval:.2e})"
