"""One place per setting: the engine's defaults are written once (config.py, engine/args.py), a speculative_config
is parsed once per LLM, and the command line reaches the engine through EngineArgs' fields."""

from __future__ import annotations

import argparse
import ast
from dataclasses import fields
from pathlib import Path

import pytest

from verispec.config import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_NUM_SEQS, DEFAULT_NUM_SPECULATIVE_TOKENS, SpeculativeConfig
from verispec.engine.args import SERVE_DEFAULTS, EngineArgs

SRC = Path(__file__).resolve().parents[1] / "src" / "verispec"
SETTINGS = {"max_num_seqs", "num_speculative_tokens", "block_size", "max_model_len", "max_num_batched_tokens",
            "kv_cache_dtype", "enable_prefix_caching", "kv_cache_memory_bytes", "scheduler"}
HOMES = {"config.py", "engine/args.py"}  # where the engine's defaults are written
# the same name for another quantity: DFlash's draft block (positions drafted at once), the training capture's own
# batch, autotune's "0 = plain decoding" for the blocks it profiles, a served model's advertised length before load,
# a rule sweep's and the drafter benchmark's fixed K (static: tau is the drafter's own), and the doctor's own check
# of the server's scheduler
OTHER_MEANING = {("audit/sweep_cli.py", "scheduler"), ("bench/drafters.py", "scheduler"), ("doctor/run.py", "scheduler"),("drafters/dflash_model.py", "block_size"), ("train/dflash.py", "block_size"),
                 ("train/data.py", "max_num_seqs"), ("execution/autotune.py", "num_speculative_tokens"),
                 ("server/protocol.py", "max_model_len")}


def literal_defaults(source: str) -> list[tuple[int, str]]:
    """(line, setting) for every literal (not None) default of a SETTINGS name: a parameter's, a dataclass field's
    or an argparse flag's (--max-num-seqs)."""
    out: list[tuple[int, str]] = []

    def literal(node: ast.AST | None) -> bool:
        return isinstance(node, ast.Constant) and node.value is not None

    for n in ast.walk(ast.parse(source)):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = n.args
            pos = a.posonlyargs + a.args
            pairs = list(zip(pos[len(pos) - len(a.defaults):], a.defaults)) + list(zip(a.kwonlyargs, a.kw_defaults))
            out += [(n.lineno, arg.arg) for arg, d in pairs if arg.arg in SETTINGS and literal(d)]
        elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id in SETTINGS \
                and literal(n.value):
            out.append((n.lineno, n.target.id))
        elif isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "add_argument" and n.args \
                and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str):
            name = n.args[0].value.lstrip("-").replace("-", "_")
            out += [(n.lineno, name) for k in n.keywords if k.arg == "default" and name in SETTINGS and literal(k.value)]
    return out


def test_finder_on_planted_source() -> None:
    src = ("def f(a, max_num_seqs=8, *, block_size=16, scheduler=None): pass\n"
           "class C:\n    num_speculative_tokens: int = 4\n    other: int = 3\n"
           "p.add_argument('--max-model-len', type=int, default=2048)\np.add_argument('--port', default=8000)\n")
    assert literal_defaults(src) == [(1, "max_num_seqs"), (1, "block_size"), (3, "num_speculative_tokens"),
                                     (5, "max_model_len")]


def test_engine_defaults_are_written_once() -> None:
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel in HOMES:
            continue
        found += [f"{rel}:{line} {name}" for line, name in literal_defaults(path.read_text())
                  if (rel, name) not in OTHER_MEANING]
    assert not found, "engine settings with a default of their own (use config.py's / engine/args.py's):\n" + \
        "\n".join(found)


def test_one_constant_per_shared_default() -> None:
    assert SpeculativeConfig().num_speculative_tokens == DEFAULT_NUM_SPECULATIVE_TOKENS
    args = EngineArgs()
    assert (args.max_num_seqs, args.block_size) == (DEFAULT_MAX_NUM_SEQS, DEFAULT_BLOCK_SIZE)
    assert set(SERVE_DEFAULTS) <= {f.name for f in fields(EngineArgs)}


def test_engine_args_from_a_command_line() -> None:
    from verispec.cli import build_parser

    ns = build_parser().parse_args(["serve", "--max-num-seqs", "3", "--no-enable-prefix-caching"])
    args = EngineArgs.from_namespace(ns, speculative_config={"method": "ngram"})
    assert (args.max_num_seqs, args.enable_prefix_caching) == (3, False)
    assert args.max_model_len == SERVE_DEFAULTS["max_model_len"] and args.scheduler == SERVE_DEFAULTS["scheduler"]
    assert args.speculative_config == {"method": "ngram"}
    plain = EngineArgs.from_namespace(build_parser().parse_args(["generate", "hi"]))
    assert plain == EngineArgs(check_state=False), "generate's flags left alone give EngineArgs' own defaults"


@pytest.mark.parametrize("bad", [{"kv_cache_dtype": "int3"}, {"block_size": 0}, {"max_num_seqs": 0},
                                 {"kv_cache_memory_bytes": -1}, {"max_model_len": 0}])
def test_engine_args_refuse_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError):
        EngineArgs(**bad)


def test_llm_takes_exactly_engine_args_keywords() -> None:
    from verispec.api import LLM

    with pytest.raises(TypeError):
        LLM(max_num_seq=4)  # a misspelt setting fails before anything loads


def test_speculative_config_is_parsed_once_per_llm(tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verispec.api import LLM

    calls = []
    original = SpeculativeConfig.from_dict.__func__

    def counting(cls, d):
        calls.append(d)
        return original(cls, d)

    monkeypatch.setattr(SpeculativeConfig, "from_dict", classmethod(counting))
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=64, speculative_config={"method": "ngram"},
              progress=False)
    assert len(calls) == 1 and llm.spec.method == "ngram"
    other = llm.with_speculation({"method": "suffix"})
    assert len(calls) == 2 and other.spec.method == "suffix"


def test_rope_tables_cover_max_model_len_and_greedy_output_stays_hf(tiny_dir: Path) -> None:
    """The RoPE tables cover max_model_len positions, not the model's max_position_embeddings (64 MiB of tables at
    Llama-3.2's 131,072 positions): the model holds what the context can reach, and a greedy continuation that ends
    at the last position equals HF transformers' (which holds its own tables)."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.helpers import CTX, hf_greedy
    from verispec import LLM, SamplingParams

    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=48, progress=False)
    assert llm.model.max_positions == 48 < CTX
    ids = list(range(5, 21))
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, torch_dtype=torch.float32).eval()
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)
    assert LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False).model.max_positions == CTX
    # a draft model's tables too: the context's, and its greedy speculative output is the target's plain one
    spec = llm.with_speculation({"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 3})
    assert spec.drafters.draft_model.max_positions == 48
    again = spec.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)[0]
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=CTX + 100,
               progress=False).model.max_positions == CTX  # never past the model's own positions


def test_a_kv_cache_larger_than_the_available_memory_fails_at_build_naming_the_settings(
        tiny_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache's pages are taken as positions are written, so a too-large one is refused when the LLM is built
    (not killed for memory later), naming what sized it; one that fits builds."""
    import os

    import verispec.api as api
    import verispec.state.kv_cache as kv_cache
    from verispec.kernels.cpu import memory_available

    got = memory_available()
    if os.path.exists("/proc/meminfo"):  # Linux says: at most the physical memory
        assert got is not None and 0 < got <= os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(kv_cache, "memory_available", lambda: 1 << 20)  # 1 MiB available
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=67108864\) but this machine has 0.00 GiB"):
        api.LLM(str(tiny_dir), dtype="float32", device="cpu", kv_cache_memory_bytes=64 << 20, progress=False)
    monkeypatch.setattr(kv_cache, "memory_available", lambda: 0)
    with pytest.raises(ValueError, match=r"max_num_seqs=4 x max_model_len=64\) but"):
        api.LLM(str(tiny_dir), dtype="float32", device="cpu", max_num_seqs=4, max_model_len=64, progress=False)
    monkeypatch.setattr(kv_cache, "memory_available", lambda: 1 << 40)
    assert api.LLM(str(tiny_dir), dtype="float32", device="cpu", max_model_len=64, progress=False).cache is not None
