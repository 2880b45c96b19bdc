"""A weight path whose linears are not batch-invariant is never chosen silently: LLM says so on stderr (and keeps
identity only up to near-ties), invariant=True refuses it, and doctor's identity check names the path's invariance."""

from __future__ import annotations

from pathlib import Path

import pytest

import verispec.api as api


def test_a_path_that_is_not_invariant_is_announced(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(api, "linears_row_invariant", lambda model: {"qkv": True, "down": False})
    llm = api.LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=64, progress=True)
    err = capsys.readouterr().err
    assert "not batch-invariant" in err and "down" in err and llm.model.batch_invariant is False
    with pytest.raises(ValueError, match="invariant=True"):
        api.LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=64, invariant=True, progress=False)


def test_an_invariant_path_says_nothing(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(api, "linears_row_invariant", lambda model: {"qkv": True, "down": True})
    llm = api.LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=64, progress=True)
    assert "batch-invariant" not in capsys.readouterr().err and llm.model.batch_invariant is True
