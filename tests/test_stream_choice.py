"""A loaded model's one-row weight streams get the kernel's prefetch level timed on its own forwards
(execution/stream_choice.py): timed, set in the kernel, kept per machine and size, read back; models below the size
keep the machine's level. That every level gives the same bits is tests/test_q8act.py's."""

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
from verispec.execution.stream_choice import choose_model_streams, kernel_weights  # noqa: E402
from verispec.kernels.kernel_choice import PREFETCH_CODES, PREFETCH_LEVELS  # noqa: E402
from verispec.kernels.q8act import Q8ActWeight  # noqa: E402

from tests.test_decoder_kernel import model  # noqa: E402,F401 - the fixture: a tiny model on the kernel

needs_vector_body = pytest.mark.skipif(not LIB.row_prefetch_choice, reason="no vector body: no level to choose")


@pytest.fixture
def levels_restored():
    """The levels in force before the test are in force after it."""
    row, pair = LIB.row_prefetch_now(), LIB.prefetch_now()
    yield
    LIB.lib.vs_set_row_prefetch(PREFETCH_CODES[row])
    LIB.lib.vs_set_prefetch(PREFETCH_CODES[pair])


def test_the_kernel_weights_are_the_q8act_linears_only(model) -> None:  # noqa: F811
    got = kernel_weights(model)
    assert len(got) == 4 * len(model.layers) and all(isinstance(w, Q8ActWeight) for w in got)
    assert got[0] is model.layers[0].qkv and got[-1] is model.layers[-1].down  # the tied head is dense here
    assert choose_model_streams(nn.Linear(4, 4), cache=None, min_bytes=0) is None  # nothing runs on the kernel


def test_a_model_below_the_size_keeps_the_machines_levels(model, tmp_path, levels_restored) -> None:  # noqa: F811
    before = LIB.row_prefetch_now(), LIB.prefetch_now()
    assert choose_model_streams(model, cache=tmp_path) is None  # a few KiB of weights: below MIN_BYTES
    assert (LIB.row_prefetch_now(), LIB.prefetch_now()) == before
    assert not (tmp_path / "kernels").exists()  # nothing timed, nothing kept


@needs_vector_body
def test_a_models_level_is_timed_on_its_forwards_set_and_kept(model, tmp_path, monkeypatch,  # noqa: F811
                                                                levels_restored) -> None:
    monkeypatch.setattr(kernel_choice, "machine_busy", lambda: False)
    nbytes = sum(w.tiles.nbytes for w in kernel_weights(model))
    with torch.inference_mode():
        ref = model.prefill_fresh(torch.arange(9), max_len=16)[2].logits
    pair = LIB.prefetch_now()
    choice = choose_model_streams(model, cache=tmp_path, min_bytes=0, repeats=1)
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
