"""What every `verispec bench` subcommand and every study under benchmarks/ shares: the argument set (the target as
the engine takes it, prompts per workload, tokens, repeats) and the small loaders they all need, so that no script
declares `--model` again or imports a sibling script."""

from __future__ import annotations

import argparse
from typing import Any

from verispec.engine.args import EngineArgs
from verispec.models.hub import DEFAULT_MODEL

DEFAULT_REPEATS = 3  # interleaved rounds: a ratio's median and spread need at least three


def add_common_args(p: argparse.ArgumentParser, *, dtype: str = EngineArgs.dtype, limit: int = 3,
                    max_tokens: int = 128, repeats: int = DEFAULT_REPEATS) -> argparse.ArgumentParser:
    """--model, --dtype, --device, --limit (prompts per workload), --max-tokens and --repeats, with the defaults a
    study may set for itself."""
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help="known model name, .gguf file, Hugging Face directory or hub id (default: %(default)s)")
    p.add_argument("--dtype", default=dtype, help="weight path: auto, float32, bfloat16, float16 (default: %(default)s)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--limit", type=int, default=limit, help="prompts per workload (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=max_tokens, help="tokens per output (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=repeats, help="interleaved rounds (default: %(default)s)")
    return p


def study_parser(doc: str | None, **defaults: Any) -> argparse.ArgumentParser:
    """A study script's parser: its docstring as the description, then the common arguments."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    return add_common_args(ap, **defaults)


def prompt_pool(llm: Any, n: int, max_tokens: int, workloads: tuple[str, ...] | None = None
                ) -> list[tuple[list[int], Any]]:
    """n greedy chat requests drawn round-robin from the shipped workloads: (prompt ids, SamplingParams)."""
    from verispec.bench.workloads import WORKLOADS, load_workload
    from verispec.sampling import SamplingParams

    sets = [load_workload(w) for w in (workloads or WORKLOADS)]
    pool = []
    for i in range(n):
        items = sets[i % len(sets)]
        wp = items[(i // len(sets)) % len(items)]
        ids = llm.tokenizer(llm.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]
        pool.append((ids, SamplingParams(temperature=0, max_tokens=min(max_tokens, wp.max_tokens))))
    return pool


def load_eagle3_beside(llm: Any, name: str) -> Any:
    """An EAGLE-3 head (a shipped name or a directory) loaded beside `llm`'s target."""
    from verispec.drafters.eagle3 import load
    from verispec.drafters.shipped import resolve

    return load(resolve(name), llm.model)


def eagle3_study(doc: str | None, max_tokens: int, limit: int = 4) -> argparse.ArgumentParser:
    """The arguments of the EAGLE-3 replays: the common set (float32 target) and --eagle3, the head."""
    ap = study_parser(doc, dtype="float32", limit=limit, max_tokens=max_tokens)
    ap.add_argument("--eagle3", default="smollm2-135m-instruct-eagle3", help="the EAGLE-3 head (shipped name or dir)")
    return ap


def load_eagle3(args: argparse.Namespace) -> tuple[Any, Any]:
    """(the target as an LLM, the EAGLE-3 head `args.eagle3` loaded beside it)."""
    from verispec.api import LLM

    llm = LLM(args.model, dtype=args.dtype, device=args.device or "cpu", progress=False)
    return llm, load_eagle3_beside(llm, args.eagle3)
