"""`SamplingParams(return_hidden_states=layers)`: the target's hidden states recorded while the engine generates.

Oracle: HF transformers' `output_hidden_states` over prompt + output[:-1] from scratch (hidden_states[i] enters
layer i; HF's last entry is after the final norm, so index L is compared through HF's own norm of ours). The
engine is driven through what changes which rows are committed: chunked prefill, several requests per step,
n-gram chains and trees whose drafts are accepted several at a time, preemption and recomputation, prefix caching,
and a stop string that cuts the output inside a step.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.helpers import sharp_llama
from verispec import LLM, SamplingParams
from verispec.models.hub import DEFAULT_MODEL
from verispec.models.loader import resolve

PROMPTS = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 7, 7, 7], [10, 20, 30, 10, 20, 30, 10], list(range(40, 50)),
           [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 5, 6, 7]]
MAX_TOKENS = [30, 12, 25, 20, 16]
LAYERS = (0, 1, 2)  # both layers' inputs and the last layer's output (index L = 2)
BLOCK = 4
BLOCK_BYTES = 2 * 2 * 2 * BLOCK * 8 * 4  # K and V x 2 layers x 2 KV heads x 4 positions x head dim 8 x fp32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer Llama with sharp distributions (repeated runs, so the n-gram drafts are accepted), with the
    default model's tokenizer files: its first 60 ids decode to text, so stop strings work."""
    d = tmp_path_factory.mktemp("llama")
    hf, _ = sharp_llama(d, 11, vocab_size=60, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    src = resolve(DEFAULT_MODEL, progress=False).directory
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, d / name)
    return str(d), hf


def hf_states(hf, ids: list[int]) -> list[torch.Tensor]:
    """HF's hidden_states over `ids` from scratch: [L + 1] of [len(ids), d]."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    return [h[0] for h in out.hidden_states]


def check_against_hf(hf, prompt: list[int], out, layers=LAYERS) -> None:
    fed = prompt + out.token_ids[:-1]  # the last output token is never fed
    ref = hf_states(hf, fed)
    assert set(out.hidden_states) == set(layers)
    for i in layers:
        got = out.hidden_states[i]
        assert got.shape == (len(fed), 32), f"layer {i}: {tuple(got.shape)} rows for {len(fed)} fed positions"
        if i == 2:  # HF's last entry is after the final norm
            got = hf.model.norm(got)
        torch.testing.assert_close(got, ref[i], atol=1e-4, rtol=1e-4, msg=f"layer {i}")


def _llm(path: str, spec: dict | None = None, **kw) -> LLM:
    return LLM(path, dtype="float32", device="cpu", max_model_len=128, speculative_config=spec, progress=False,
               block_size=BLOCK, scheduler="static", **kw)


def _params(layers=LAYERS) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, return_hidden_states=layers)
            for n in MAX_TOKENS]


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


@pytest.fixture(scope="module")
def eagle3_head(tiny, tmp_path_factory) -> str:
    """A random EAGLE-3 head reading layer 1 while the requests record 0 and 2: each step captures both sets."""
    from verispec.drafters.eagle3 import Eagle3Config, Eagle3Head
    from verispec.models.loader import load_model

    model, _ = load_model(tiny[0], dtype="float32", device="cpu", progress=False)
    torch.manual_seed(5)
    head = Eagle3Head(Eagle3Config.for_target(model, (1,), draft_vocab_size=60), model)
    d = tmp_path_factory.mktemp("eagle3")
    head.save_pretrained(d)
    return str(d)


@pytest.mark.parametrize("case", ["plain", "ngram", "ngram-tree", "preempted", "prefix-cached", "eagle3"])
def test_recorded_states_equal_hf_from_scratch(tiny, case, request):
    path, hf = tiny
    kw: dict = {"max_num_seqs": 3, "max_num_batched_tokens": 8}  # prompts prefill in chunks beside decodes
    spec = {"plain": None, "ngram": NGRAM, "ngram-tree": {**NGRAM, "draft_tree": True}, "preempted": NGRAM,
            "prefix-cached": NGRAM, "eagle3": {"method": "eagle3", "num_speculative_tokens": 3, "adaptive": False}}[case]
    if case == "eagle3":
        spec["model"] = request.getfixturevalue("eagle3_head")
    if case == "preempted":
        kw = {"max_num_seqs": 5, "kv_cache_memory_bytes": 14 * BLOCK_BYTES}
    if case == "prefix-cached":
        kw["enable_prefix_caching"] = True
    llm = _llm(path, spec, **kw)
    if case == "prefix-cached":  # the prompts' blocks are cached first; a request that records must not skip them
        llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=2),
                     use_tqdm=False)
    layers = (0, 2) if case == "eagle3" else LAYERS
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], _params(layers), use_tqdm=False)
    if spec is not None and case != "eagle3":  # a random head's drafts are mostly rejected
        assert sum(o.stats["num_accepted_tokens"] for o in outs) > 10, "drafts were meant to be accepted"
    if case == "preempted":
        assert llm.engine.num_preemptions > 0, "the pool was meant to run out"
    for p, o in zip(PROMPTS, outs):
        check_against_hf(hf, p, o, layers)


def test_a_stop_string_cut_keeps_the_rows_of_the_kept_tokens(tok_dir_llm):
    """Outputs ending at a stop string, some inside an accepted block (tokens past it were committed, then cut):
    the rows end with the kept tokens."""
    llm, hf, prompt, text = tok_dir_llm
    trimmed = 0
    for i in range(2, min(len(text) - 3, 24)):
        stop = text[i : i + 3]
        out = llm.generate({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], return_hidden_states=(0, 2)),
            use_tqdm=False)[0]
        assert out.finish_reason == "stop" and out.stop_reason == stop
        trimmed += out.stats["stop_trimmed_tokens"] > 0
        fed = prompt + out.token_ids[:-1]
        ref = hf_states(hf, fed)
        assert out.hidden_states[0].shape[0] == len(fed), f"stop {stop!r}"
        torch.testing.assert_close(out.hidden_states[0], ref[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(hf.model.norm(out.hidden_states[2]), ref[2], atol=1e-4, rtol=1e-4)
    assert trimmed, "no stop string ended inside an accepted block"


@pytest.fixture(scope="module")
def tok_dir_llm(tiny):
    """The tiny model speculating, with a tokenizer (stop strings need one), and its plain greedy text."""
    path, hf = tiny
    llm = _llm(path, NGRAM)
    prompt = PROMPTS[0]
    plain = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                         use_tqdm=False)[0]
    assert len(plain.text) > 12
    return llm, hf, prompt, plain.text


def test_bad_layers_are_refused(tiny):
    path, _ = tiny
    with pytest.raises(ValueError, match="return_hidden_states"):
        SamplingParams(return_hidden_states=True)
    with pytest.raises(ValueError, match="return_hidden_states"):
        SamplingParams(return_hidden_states=[0, -1])
    llm = _llm(path)
    with pytest.raises(ValueError, match=r"layers \[3\] are outside 0..2"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=2, return_hidden_states=(0, 3)),
                     use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert out.hidden_states is None
