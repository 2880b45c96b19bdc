"""A loaded model's one-row weight streams get the kernel's prefetch level, and the AVX-512 body its pair threshold,
timed on its own forwards (execution/stream_choice.py): timed, set in the kernel, kept per machine and size, read
back; models below the size keep the machine's settings. That every level and threshold gives the same bits is
tests/test_q8act.py's and tests/test_kquant.py's."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from verispec.kernels.cpu_build import KernelUnavailable
from verispec.kernels.cpu_kernels import load

try:
    LIB = load()
except KernelUnavailable as e:  # no C compiler here: no kernel weights, nothing to choose
    pytest.skip(f"verispec's CPU kernel cannot be built here: {e}", allow_module_level=True)

import verispec.kernels.kernel_choice as kernel_choice  # noqa: E402
from verispec.execution.stream_choice import (PAIR_CANDIDATES, PAIR_ENV, choose_model_streams,  # noqa: E402
                                              kernel_weights, pair_rows_by)
from verispec.kernels.kernel_choice import PREFETCH_CODES, PREFETCH_LEVELS  # noqa: E402
from verispec.kernels.q8act import Q8ActWeight  # noqa: E402

from tests.test_decoder_kernel import model  # noqa: E402,F401 - the fixture: a tiny model on the kernel

needs_vector_body = pytest.mark.skipif(not LIB.row_prefetch_choice, reason="no vector body: no level to choose")


@pytest.fixture
def levels_restored():
    """The levels in force before the test are in force after it."""
    row, pair, pair_rows = LIB.row_prefetch_now(), LIB.prefetch_now(), LIB.lib.vs_set_pair_rows(0)
    yield
    LIB.lib.vs_set_row_prefetch(PREFETCH_CODES[row])
    LIB.lib.vs_set_prefetch(PREFETCH_CODES[pair])
    LIB.lib.vs_set_pair_rows(pair_rows)


def test_the_kernel_weights_are_the_q8act_linears_only(model) -> None:  # noqa: F811
    got = kernel_weights(model)
    assert len(got) == 4 * len(model.layers) and all(isinstance(w, Q8ActWeight) for w in got)
    assert got[0] is model.layers[0].qkv and got[-1] is model.layers[-1].down  # the tied head is dense here
    assert choose_model_streams(nn.Linear(4, 4), cache=None, min_bytes=0) is None  # nothing runs on the kernel


def test_a_model_below_the_size_keeps_the_machines_levels(model, tmp_path, levels_restored) -> None:  # noqa: F811
    before = LIB.row_prefetch_now(), LIB.prefetch_now(), LIB.lib.vs_set_pair_rows(0)
    assert choose_model_streams(model, cache=tmp_path) is None  # a few KiB of weights: below MIN_BYTES
    assert (LIB.row_prefetch_now(), LIB.prefetch_now(), LIB.lib.vs_set_pair_rows(0)) == before
    assert not (tmp_path / "kernels").exists()  # nothing timed, nothing kept


@needs_vector_body
def test_a_models_level_is_timed_on_its_forwards_set_and_kept(model, tmp_path, monkeypatch,  # noqa: F811
                                                                levels_restored) -> None:
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: False)
    nbytes = sum(w.tiles.nbytes for w in kernel_weights(model))
    with torch.inference_mode():
        ref = model.prefill_fresh(torch.arange(9), max_len=16)[2].logits
    pair = LIB.prefetch_now()
    choice = choose_model_streams(model, cache=tmp_path, min_bytes=0, repeats=1, pair_repeats=1)
    assert choice is not None and choice.level in PREFETCH_LEVELS and choice.nbytes == nbytes
    assert all(f"{lv.upper()} " in choice.why for lv in PREFETCH_LEVELS) and "one-row forward" in choice.why
    assert LIB.row_prefetch_now() == choice.level  # set in the kernel, for the process
    assert LIB.prefetch_now() == pair  # the pair streams keep the machine's level
    kept, = (tmp_path / "kernels").glob("row-prefetch-*-model-1mib.json")  # its size class
    assert json.loads(kept.read_text())["level"] == choice.level
    # a later load of a model of that size reads the kept levels (here ones the test wrote) and sets them
    other = next(lv for lv in PREFETCH_LEVELS if lv != choice.level)
    kept.write_text(json.dumps({"level": other, "why": "written by the test"}))
    again = choose_model_streams(model, cache=tmp_path, min_bytes=0)
    assert (again.level, again.why) == (other, "written by the test, cached")
    assert LIB.row_prefetch_now() == other
    with torch.inference_mode():  # the timing left the model as it was: the same logits from a fresh prefill
        assert torch.equal(model.prefill_fresh(torch.arange(9), max_len=16)[2].logits, ref)


@needs_vector_body
def test_the_stats_report_the_levels_in_force(levels_restored) -> None:
    from verispec.execution.autotune import PathChoice
    from verispec.execution.paths import PATHS
    from verispec.kernels.cpu import cpu_info

    path = next(p for p in PATHS.values() if p.quantization == "gguf-q8act")
    choice = PathChoice(path, (1,), {}, cpu_info(), cached=False, explicit=True)
    for level in PREFETCH_LEVELS:
        with LIB.row_prefetching(level):
            assert choice.as_dict()["kernel_row_prefetch"] == level
        if LIB.prefetch_choice:
            with LIB.prefetching(level):
                assert choice.as_dict()["kernel_prefetch"] == level


def test_the_pair_threshold_is_where_pairs_win_at_every_larger_row_count() -> None:
    one = (1.0, 1.0)  # no faster with pairs
    win = (0.9, 1.0)
    assert pair_rows_by({2: win, 3: win, 4: win, 5: win}) == 2
    assert pair_rows_by({2: one, 3: win, 4: win, 5: win}) == 3
    assert pair_rows_by({2: win, 3: one, 4: win, 5: win}) == 4  # a loss at 3 rows: pairs start after it
    assert pair_rows_by({2: win, 3: win, 4: win, 5: one}) == 5  # a loss at the largest: the build's threshold
    assert pair_rows_by({2: (0.98, 1.0), 3: win, 4: win, 5: win}) == 3  # 2% is within the margin


@pytest.mark.skipif(LIB.body != "avx512-vnni", reason="only the AVX-512 body runs pairs")
def test_a_models_pair_threshold_is_timed_set_kept_and_named(model, tmp_path, monkeypatch,  # noqa: F811
                                                              levels_restored) -> None:
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: False)
    with torch.inference_mode():
        ref = model.prefill_fresh(torch.arange(9), max_len=16)[2].logits
    choice = choose_model_streams(model, cache=tmp_path, min_bytes=0, repeats=1, pair_repeats=1)
    assert choice.pair_rows in PAIR_CANDIDATES and LIB.lib.vs_set_pair_rows(0) == choice.pair_rows
    assert all(f"{m} rows " in choice.pair_why for m in PAIR_CANDIDATES) and "with pairs" in choice.pair_why
    kept, = (tmp_path / "kernels").glob("pair-rows-*-model-1mib.json")
    assert json.loads(kept.read_text())["level"] == str(choice.pair_rows)
    kept.write_text(json.dumps({"level": "4", "why": "written by the test"}))
    again = choose_model_streams(model, cache=tmp_path, min_bytes=0)
    assert (again.pair_rows, again.pair_why) == (4, "written by the test, cached") and LIB.lib.vs_set_pair_rows(0) == 4
    monkeypatch.setenv(PAIR_ENV, "2")
    named = choose_model_streams(model, cache=tmp_path, min_bytes=0)
    assert (named.pair_rows, LIB.lib.vs_set_pair_rows(0)) == (2, 2) and PAIR_ENV in named.pair_why
    monkeypatch.setenv(PAIR_ENV, "two")
    with pytest.raises(ValueError, match="VERISPEC_CPU_PAIR_ROWS=two: expected a row count"):
        choose_model_streams(model, cache=tmp_path, min_bytes=0)
    monkeypatch.setenv(PAIR_ENV, "2")
    assert "two tiles per vector from 2 rows on" in named.describe()
    from verispec.execution.autotune import PathChoice
    from verispec.execution.paths import PATHS
    from verispec.kernels.cpu import cpu_info

    path = next(p for p in PATHS.values() if p.quantization == "gguf-q8act")
    assert PathChoice(path, (1,), {}, cpu_info(), cached=False, explicit=True).as_dict()["kernel_pair_rows"] == 2
    with torch.inference_mode():  # the timing left the model as it was
        assert torch.equal(model.prefill_fresh(torch.arange(9), max_len=16)[2].logits, ref)
