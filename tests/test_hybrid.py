"""Hybrid drafting (drafters/hybrid.py, the engine's second drafting stage): which side proposes and hears what,
the two sides' estimates kept apart, and the configuration's refusals. The engine end to end (greedy output equal
to HF's, the state oracle on, both sides drafting) is in test_eagle3.py."""

from __future__ import annotations

import pytest
import torch

from verispec.bench.single import method_spec
from verispec.config import SpeculativeConfig
from verispec.drafters.base import Draft
from verispec.drafters.hybrid import HybridDrafter
from verispec.engine.acceptance import AcceptanceEstimator
from verispec.engine.plan import LiveRequest, Side
from verispec.sampling import SamplingParams
from verispec.state.request import Request


class Fake:
    """A drafter that proposes `tokens` and records every call it gets."""

    def __init__(self, tokens: list[int], features: bool = False) -> None:
        self.tokens, self.calls = tokens, []
        if features:
            self.feature_layers = (0, 1)

    def propose(self, context, k):
        self.calls.append(("propose", k))
        return Draft(self.tokens[:k])

    def observe(self, accepted):
        self.calls.append(("observe", accepted))

    def add_features(self, feats):
        self.calls.append(("features", feats.shape[0]))

    def check_state(self, ref, tokens):
        self.calls.append(("check", len(tokens)))

    def release(self, tokens=None):
        self.calls.append(("release", None if tokens is None else len(tokens)))


def test_each_side_proposes_when_chosen_and_hears_only_its_own_verdict():
    free, model = Fake([7, 8, 9]), Fake([4, 5], features=True)
    h = HybridDrafter(free, model)
    assert h.feature_layers == (0, 1)  # the engine captures what the model side reads
    assert h.propose([1, 2], 3).tokens == [7, 8, 9]
    h.observe(2)
    h.use_model = True
    assert h.propose([1, 2, 7, 8, 9], 2).tokens == [4, 5]
    h.observe(0)
    h.add_features(torch.zeros(3, 4))
    h.check_state(torch.zeros(5, 4), [1, 2, 3, 4, 5])
    h.release([1, 2, 3])
    assert free.calls == [("propose", 3), ("observe", 2), ("release", 3)]
    assert model.calls == [("propose", 2), ("observe", 0), ("features", 3), ("check", 5), ("release", 3)]
    assert h.proposals == {"free": 1, "model": 1}


def test_an_empty_proposal_leaves_no_verdict_to_hear():
    free, model = Fake([]), Fake([])
    h = HybridDrafter(free, model)
    h.propose([1], 2)
    h.observe(0)  # the engine does not call it after an empty draft; if it did, nobody proposed
    assert ("observe", 0) not in free.calls + model.calls


def test_switching_sides_swaps_estimates_and_forgets_the_step_draft():
    h = HybridDrafter(Fake([1]), Fake([2]))
    free_est, model_est = AcceptanceEstimator(), AcceptanceEstimator()
    lv = LiveRequest(Request([1, 2, 3], SamplingParams(temperature=0)), h, free_est, None, None,
                     other=Side(model_est, confidences=False, one_pass=True))
    lv.draft, lv.proposed_tokens, lv.draft_s, lv.shadow = Draft([1]), 1, 0.5, 1
    lv.switch_side()
    assert lv.estimator is model_est and h.use_model and lv.on_model
    assert (lv.confidences, lv.one_pass) == (False, True)
    assert (lv.draft.tokens, lv.proposed_tokens, lv.draft_s, lv.shadow) == ([], 0, 0.0, None)
    lv.model_free_side()
    assert lv.estimator is free_est and not h.use_model and not lv.on_model
    assert lv.other is not None and lv.other.estimator is model_est
    lv.model_free_side()  # already there: nothing moves
    assert lv.estimator is free_est


def test_config_refuses_what_a_hybrid_cannot_be():
    ok = SpeculativeConfig(method="eagle3", model="x", hybrid="suffix")
    assert ok.hybrid == "suffix"
    with pytest.raises(ValueError, match="model-free"):
        SpeculativeConfig(method="eagle3", model="x", hybrid="eagle3")
    with pytest.raises(ValueError, match="goes with a model drafter"):
        SpeculativeConfig(method="ngram", hybrid="suffix")
    with pytest.raises(ValueError, match="chains only"):
        SpeculativeConfig(method="eagle3", model="x", hybrid="ngram", draft_tree=True)


def test_bench_method_names_spell_hybrids():
    assert method_spec("suffix+dflash:/d", 5) == {"method": "dflash", "num_speculative_tokens": 5, "model": "/d",
                                                  "hybrid": "suffix"}
    with pytest.raises(ValueError, match="goes first of a model drafter"):
        method_spec("suffix+ngram", 5)


def test_cli_hybrid_flag_goes_into_the_speculative_config():
    from verispec.cli import _spec_config, build_parser

    args = build_parser().parse_args(["generate", "hi", "--method", "dflash", "--hybrid", "suffix", "-k", "6"])
    assert _spec_config(args) == {"method": "dflash", "hybrid": "suffix", "num_speculative_tokens": 6}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "hi", "--method", "dflash", "--hybrid", "eagle3"])


class Stopper(Fake):
    """A drafter that stops early: records the floor it is asked with."""

    stops_early = True

    def propose(self, context, k, min_survival=0.0):
        self.calls.append(("propose", k, min_survival))
        return Draft(self.tokens[:k], confidence=[0.5] * min(k, len(self.tokens)))


def test_a_survival_floor_reaches_only_a_drafter_that_stops_early_on_either_side():
    """LiveRequest.propose(k, floor) hands the floor to a drafter that stops early (alone, or as the hybrid side now
    drafting, with that side's trait in force) and calls any other as propose(context, k)."""
    alone = Stopper([4, 5, 6])
    lv = LiveRequest(Request([1, 2, 3], SamplingParams(temperature=0)), alone, AcceptanceEstimator(), None, None,
                     stops_early=True)
    assert lv.propose(3, 0.25).tokens == [4, 5, 6] and lv.propose(2).tokens == [4, 5]
    assert alone.calls == [("propose", 3, 0.25), ("propose", 2, 0.0)]
    free, model = Fake([7, 8]), Stopper([9, 9])
    h = HybridDrafter(free, model)
    assert not h.stops_early  # the model-free side's trait; the model side's waits on its Side
    lv = LiveRequest(Request([1, 2, 3], SamplingParams(temperature=0)), h, AcceptanceEstimator(), None, None,
                     stops_early=h.stops_early, other=Side(AcceptanceEstimator(), stops_early=True))
    lv.propose(2, 0.3)
    lv.switch_side()
    assert lv.stops_early
    lv.propose(2, 0.3)
    lv.model_free_side()
    assert not lv.stops_early
    assert free.calls == [("propose", 2)] and model.calls == [("propose", 2, 0.3)]
