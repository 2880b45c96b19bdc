"""Greedy equality on the real default model (fp32) over every shipped workload prompt, for every drafter.

A divergence is reported with its position and the target's top-1/top-2 margin; only near-ties may pass.
"""

from __future__ import annotations

import pytest

from verispec import LLM, SamplingParams
from verispec.bench.workloads import WORKLOADS, load_workload
from verispec.check.identity import compare_greedy

pytestmark = pytest.mark.slow
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def plain():
    # 8 requests decode together, as in serving (rows of one fp32 forward can differ by ~1e-5 with the batch: only
    # near-ties may diverge, which is what the check allows)
    return LLM(dtype="float32", device="cpu", max_model_len=1024, progress=False, max_num_seqs=8)


def _ids(llm, wp):
    return llm.tokenizer(llm.apply_chat_template(list(wp.messages)), add_special_tokens=False)["input_ids"]


_PLAIN: dict[str, list[int]] = {}  # prompt id -> plain output, shared by the drafters' tests


def _check(plain, fast, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    ids = {wp.id: _ids(plain, wp) for wp in prompts}
    todo = [wp for wp in prompts if wp.id not in _PLAIN]
    outs = plain.generate([{"prompt_token_ids": ids[wp.id]} for wp in todo], params, use_tqdm=False)
    _PLAIN.update((wp.id, o.token_ids) for wp, o in zip(todo, outs))
    spec = fast.generate([{"prompt_token_ids": ids[wp.id]} for wp in prompts], params, use_tqdm=False)
    failures, drafted = [], 0
    for wp, b in zip(prompts, spec):
        drafted += b.stats["num_draft_tokens"]
        div = compare_greedy(plain.model, ids[wp.id], _PLAIN[wp.id], b.token_ids)
        if div is not None and not div.near_tie:
            failures.append(f"{wp.id}: {div}")
    assert not failures, "\n".join(failures)
    assert drafted > 0


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_model_free_drafters_identical_on_all_workloads(plain, method):
    fast = plain.with_speculation({"method": method, "num_speculative_tokens": 6, "adaptive": False})
    prompts = [wp for wl in WORKLOADS for wp in load_workload(wl)]
    assert len(prompts) >= 100
    _check(plain, fast, prompts)


def test_draft_model_identical(plain):
    # the target's own weights in bf16 as draft model: a cheap way to get a q close to, but not equal to, p
    fast = plain.with_speculation({"method": "draft_model", "model": "smollm2-135m-instruct",
                                   "draft_dtype": "bfloat16", "num_speculative_tokens": 4, "adaptive": False})
    _check(plain, fast, [load_workload(wl, limit=1)[0] for wl in WORKLOADS])
