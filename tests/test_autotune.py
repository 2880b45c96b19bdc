"""dtype="auto": the weight path is chosen by a measured, cached profile, and every output says which path ran
on which CPU. The arithmetic of the choice is checked against hand-computed costs; the CPU flags against
/proc/cpuinfo read independently; the profile cache by what it writes and reads back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verispec.config import ModelConfig
from verispec.execution import autotune
from verispec.execution.autotune import choose, expected_cost, profile_paths, resolve_path, typical_blocks
from verispec.kernels.cpu import KERNEL_FLAGS, cpu_info
from verispec.execution.paths import PATHS, candidates, path_for

CPU = cpu_info()
TINY = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def test_expected_cost_interpolates_between_profiled_sizes_and_grows_past_the_last():
    table = {1: 10.0, 4: 16.0, 8: 40.0}
    assert expected_cost(table, (1,)) == 10.0
    assert expected_cost(table, (2,)) == pytest.approx(12.0)  # 10 + (16 - 10) * 1/3
    assert expected_cost(table, (6,)) == pytest.approx(28.0)  # halfway from 16 to 40
    assert expected_cost(table, (16,)) == pytest.approx(80.0)  # proportional beyond M = 8
    assert expected_cost(table, (1, 8)) == pytest.approx(25.0)


def test_typical_blocks_are_single_tokens_plainly_and_both_ends_when_speculating():
    assert typical_blocks(0) == (1,)
    assert typical_blocks(8) == (1, 9)


def test_the_cheapest_path_wins_and_near_ties_go_to_the_more_exact_path():
    paths = [PATHS["fp32"], PATHS["bf16"], PATHS["gguf-int4"]]
    table = {"fp32": {1: 59.0, 8: 112.0}, "bf16": {1: 22.0, 8: 120.0}, "gguf-int4": {1: 13.0, 8: 42.0}}
    assert choose(paths, table, (1,), CPU, cached=False).path.name == "gguf-int4"
    # plain decoding on a machine where bf16 is far cheaper at one token but dreadful in blocks
    table2 = {"fp32": {1: 59.0, 8: 112.0}, "bf16": {1: 22.0, 8: 400.0}}
    assert choose(paths[:2], table2, (1,), CPU, cached=False).path.name == "bf16"
    assert choose(paths[:2], table2, (1, 8), CPU, cached=False).path.name == "fp32"  # 85.5 vs 211
    near = {"fp32": {1: 100.0}, "bf16": {1: 96.0}}
    assert choose(paths[:2], near, (1,), CPU, cached=False).path.name == "fp32"  # within 5 %: the exact one


def test_candidates_depend_on_device_and_checkpoint():
    assert [p.name for p in candidates("cuda", True)] == ["bf16"]
    assert [p.name for p in candidates("cpu", False)] == ["fp32", "bf16"]
    from verispec.kernels.int4 import int4_kernel_available

    from verispec.kernels.cpu_kernels import fast_kernel_available

    expected = ["fp32", "bf16"] + (["gguf-int4"] if int4_kernel_available() else []) + (
        ["gguf-q8act"] if fast_kernel_available()[0] else [])
    assert [p.name for p in candidates("cpu", True)] == expected


def test_explicit_dtype_or_quantization_names_the_path_without_measuring(monkeypatch):
    monkeypatch.setattr(autotune, "measure_paths", lambda *a: pytest.fail("an explicit path must not be measured"))
    assert resolve_path("float32", None, "cpu", TINY, True).path == PATHS["fp32"]
    assert resolve_path("bfloat16", None, "cpu", TINY, True).path == PATHS["bf16"]
    choice = resolve_path("auto", "gguf", "cpu", TINY, True)
    assert choice.path == PATHS["gguf-int4"] and choice.explicit
    with pytest.raises(ValueError, match="unknown dtype"):
        path_for("int3", None)


def test_cpu_flags_are_the_kernel_flags_proc_cpuinfo_lists():
    assert set(CPU.flags) <= set(KERNEL_FLAGS)
    assert CPU.capability == torch.backends.cpu.get_cpu_capability()
    proc = Path("/proc/cpuinfo")
    if not proc.exists():
        pytest.skip("no /proc/cpuinfo on this platform")
    listed = set()
    for line in proc.read_text().splitlines():
        if line.startswith("flags"):
            listed |= set(line.split(":", 1)[1].split())
    assert set(CPU.flags) == listed & set(KERNEL_FLAGS)
    assert CPU.label().startswith(CPU.capability)


def test_the_profile_is_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    paths = [PATHS["fp32"], PATHS["bf16"]]
    table, cached = profile_paths(TINY, "cpu", paths, tmp_path)
    assert not cached and set(table) == {"fp32", "bf16"}
    assert all(set(t) == set(autotune.PROFILE_M) and all(ms > 0 for ms in t.values()) for t in table.values())
    files = list((tmp_path / "kernels").glob("*.json"))
    assert len(files) == 1
    stored = json.loads(files[0].read_text())
    assert stored["cpu"]["cpu_flags"] == " ".join(CPU.flags) and stored["threads"] == torch.get_num_threads()
    monkeypatch.setattr(autotune, "measure_paths", lambda *a: pytest.fail("a cached profile must not be re-measured"))
    again, cached = profile_paths(TINY, "cpu", paths, tmp_path)
    assert cached and again == table
    # another thread count is another machine, as far as kernels go
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    with pytest.raises(pytest.fail.Exception):
        profile_paths(TINY, "cpu", paths, tmp_path)


def test_a_busy_machine_measures_but_does_not_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "machine_busy", lambda: True)
    choice = resolve_path("auto", None, "cpu", TINY, False, cache=tmp_path)
    assert not choice.cached and not (tmp_path / "kernels").exists()
    assert choice.path.name in ("fp32", "bf16") and set(choice.expected) == {"fp32", "bf16"}


def test_a_busy_machine_reads_the_profile_a_quiet_one_cached(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "machine_busy", lambda: False)
    quiet = resolve_path("auto", None, "cpu", TINY, False, cache=tmp_path)
    monkeypatch.setattr(autotune, "machine_busy", lambda: True)
    monkeypatch.setattr(autotune, "measure_paths", lambda *a: pytest.fail("a cached profile must not be re-measured"))
    busy = resolve_path("auto", None, "cpu", TINY, False, cache=tmp_path)
    assert busy.cached and busy.path == quiet.path and busy.expected == quiet.expected


def test_outputs_and_metrics_say_which_path_ran_and_on_which_cpu(tiny_dir):
    from fastapi.testclient import TestClient

    from tests.helpers import make_app
    from verispec import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False, max_num_seqs=1)
    stats = llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2), use_tqdm=False)[0].stats
    assert stats["path"] == "fp32" and stats["dtype"] == "float32" and stats["path_chosen_by"] == "explicit"
    assert stats["cpu_flags"] == " ".join(CPU.flags) and stats["cpu_capability"] == CPU.capability
    app, _ = make_app(tiny_dir, manage_engine=False)
    body = TestClient(app).get("/metrics").text
    line = next(x for x in body.splitlines() if x.startswith("verispec:engine_config_info{"))
    assert 'path="fp32"' in line and 'quantization="none"' in line and 'device="cpu"' in line
    assert 'speculative_method="none"' in line and 'drafter_weights="none"' in line
    assert stats["drafter_weights"] is None
    assert f'cpu_capability="{CPU.capability}"' in line and line.endswith(" 1.0")


def test_auto_loads_the_path_the_profile_finds_cheapest_for_its_blocks(tiny_dir, tmp_path, monkeypatch):
    from verispec import LLM

    monkeypatch.setenv("VERISPEC_CACHE", str(tmp_path))  # a fresh profile cache
    monkeypatch.setattr(autotune, "machine_busy", lambda: False)
    table = {"fp32": {1: 50.0, 8: 60.0, 16: 70.0}, "bf16": {1: 20.0, 8: 150.0, 16: 300.0}}
    monkeypatch.setattr(autotune, "measure_paths", lambda paths, cfg, kinds=None: {p.name: table[p.name] for p in paths})
    plain = LLM(str(tiny_dir), device="cpu", progress=False, max_num_seqs=1)
    assert plain.path_choice.path.name == "bf16" and plain.model.dtype == torch.bfloat16
    assert not plain.path_choice.explicit and plain.path_choice.blocks == (1,)
    spec = LLM(str(tiny_dir), device="cpu", progress=False, max_num_seqs=1,
               speculative_config={"method": "ngram", "num_speculative_tokens": 7})
    # blocks 1 and 8: fp32 (50 + 60) / 2 = 55 against bf16 (20 + 150) / 2 = 85; read from the cache this time
    assert spec.path_choice.path.name == "fp32" and spec.model.dtype == torch.float32 and spec.path_choice.cached


def test_gguf_q8act_is_timed_in_the_files_formats(monkeypatch):
    """A mapping of the GGUF's formats (models/quantized.py's gguf_block_linears) offers the path and is what its
    random weights are built in; the profile is kept apart from one timed in other formats."""
    from verispec.kernels.cpu_kernels import fast_kernel_available

    if not fast_kernel_available()[0]:
        pytest.skip("verispec's kernel with a vector body is not available here")
    kinds = {"qkv": "Q4_K", "o": "Q5_0", "gate_up": "Q6_K", "down": "Q8_0", "head": "Q6_K"}
    cfg = ModelConfig.from_hf(dict(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    bench = autotune._PathBench(PATHS["gguf-q8act"], cfg, kinds)
    assert [f.__self__.kind for f in bench.layers[0]] == ["Q4_K", "Q5_0", "Q6_K", "Q8_0"]
    assert bench.head.__self__.kind == "Q6_K"
    assert autotune.profile_key(cfg, "cpu", [PATHS["gguf-q8act"]], kinds) != autotune.profile_key(
        cfg, "cpu", [PATHS["gguf-q8act"]])
    assert PATHS["gguf-q8act"] in candidates("cpu", False, kinds)


def test_the_profile_times_part_of_a_large_head_and_scales_it():
    """The profile must not hold a dense [150k, 1536] fp32 head (0.9 GB: more than a 1.5B Q4_K_M model itself):
    it times as many rows as stream STREAM_BYTES and scales the time by vocab / rows."""
    from types import SimpleNamespace

    cfg = SimpleNamespace(vocab_size=151936, hidden_size=1536)
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        fn, rows = autotune._head_fn(path_for(dtype, None), cfg)  # type: ignore[arg-type]
        assert rows < cfg.vocab_size and rows * cfg.hidden_size * size <= autotune.STREAM_BYTES + cfg.hidden_size * size
        assert rows * cfg.hidden_size * size >= autotune.STREAM_BYTES  # still more than a cache holds
        assert fn(torch.randn(1, cfg.hidden_size).to(getattr(torch, dtype))).shape == (1, rows)
    small = SimpleNamespace(vocab_size=2048, hidden_size=64)
    assert autotune._head_fn(path_for("float32", None), small)[1] == 2048  # a small head is timed whole
