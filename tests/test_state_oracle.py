"""--check-state: the oracle recomputes the KV from scratch after every step, and catches a real state bug."""

from __future__ import annotations

import pytest
import torch

from verispec import LLM, SamplingParams
from verispec.check.state import StateMismatch
from verispec.state.kv_cache import KVCache
from verispec.state.paged_kv import PagedKVCache


@pytest.fixture(scope="module")
def window_model(tmp_path_factory):
    from transformers import AutoModelForCausalLM, MistralConfig

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, max_position_embeddings=128, sliding_window=4)
    d = tmp_path_factory.mktemp("mistral")
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return str(d)


def _run(model_dir, temperature=0.0):
    # the target drafts for itself: drafts are mostly accepted, so most steps commit several positions
    spec = {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(model_dir, dtype="float32", device="cpu", speculative_config=spec, check_state=True)
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True, seed=3)
    return llm.generate({"prompt_token_ids": [5, 9, 2, 7, 7, 1]}, params)[0]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_oracle_passes_on_correct_state(window_model, temperature):
    out = _run(window_model, temperature)
    assert len(out.token_ids) == 24
    assert out.stats["mean_acceptance_length"] > 1.5  # multi-token commits happened and were checked


def test_oracle_catches_bonus_only_writeback(window_model, monkeypatch):
    """The ported-drafter bug: of the accepted positions only the last (bonus) one is written back."""
    real_commit = KVCache.commit

    def buggy_commit(self, slot, n):
        start = self.slots[slot].length
        real_commit(self, slot, n)
        if n > 1:  # positions start .. start+n-2 keep whatever stale values they had: here, zeros
            for t in self.k + self.v:
                t[slot, :, start : start + n - 1] = 0

    monkeypatch.setattr(KVCache, "commit", buggy_commit)
    with pytest.raises(StateMismatch, match="differs at position"):
        _run(window_model)


def test_oracle_catches_bonus_only_writeback_in_the_paged_cache(window_model, monkeypatch):
    """The same bug in the target's paged cache (through its block tables): the target's check names it."""
    real_commit = PagedKVCache.commit

    def buggy_commit(self, slot, n):
        start = self.slots[slot].length
        real_commit(self, slot, n)
        if n > 1:
            phys = self.positions(slot, start, n - 1)
            for t in self.k + self.v:
                t[0, :, phys] = 0

    monkeypatch.setattr(PagedKVCache, "commit", buggy_commit)
    with pytest.raises(StateMismatch, match="target: . of layer 0 differs at position"):
        _run(window_model)


def test_oracle_catches_a_leaked_block(window_model, monkeypatch):
    """A block holding only rejected positions that is not given back: the paged cache's invariants catch it."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": False}
    llm = LLM(window_model, dtype="float32", device="cpu", speculative_config=spec, check_state=True, block_size=2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 2, 7, 5, 9, 3, 7, 5, 9, 2, 1]}
    out = llm.generate(prompt, params)[0]  # correct: passes, with drafts rejected (rejected blocks given back)
    assert out.stats["mean_acceptance_length"] < 1 + 3
    monkeypatch.setattr(PagedKVCache, "_trim", lambda self, s, length: None)
    with pytest.raises(AssertionError, match="table / positions out of step"):
        llm.generate(prompt, params)
