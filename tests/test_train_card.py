"""A trained drafter's model card states how it was trained: its training rate and, where it trained under bf16
autocast, that precision (read from the train log the loop writes)."""

from __future__ import annotations

import json

import pytest

from verispec.train.card import write_card


@pytest.mark.parametrize("amp", ["bf16", "off", None])
def test_the_card_names_bf16_autocast_where_training_ran_under_it(tmp_path, amp):
    data, drafter = tmp_path / "data", tmp_path / "drafter"
    data.mkdir(), drafter.mkdir()
    (data / "meta.json").write_text(json.dumps({
        "num_sequences": 8, "response_tokens": 900, "tokens": 1200, "modes": ["greedy"], "max_tokens": 128,
        "sources": ["test"], "generate_s": 60.0, "capture_s": 0.0}))
    log = {"wall_s": 120.0, "train_tokens_per_s": 376.0, "world_size": 1, **({"amp": amp} if amp else {})}
    (drafter / "train_log.json").write_text(json.dumps(log))
    text = write_card(drafter, "eagle3", commands=["verispec train eagle3 ..."], data_dir=data,
                      measured="tau 1.5").read_text()
    assert "376 trained positions per second of step time on 1 rank(s)" in text
    assert ("bf16 autocast" in text) == (amp == "bf16")
