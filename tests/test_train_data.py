"""`verispec train data`: the captured states equal HF transformers' hidden states, shards resume after an
interruption with identical content, mismatched settings are refused, the project corpus avoids benchmark prompts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from verispec import LLM
from verispec.train.data import generate_data
from verispec.train.shards import load_all, read_meta, shard_name, target_logits, write_meta


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=128, eos_token_id=None, bos_token_id=None)
    hf = AutoModelForCausalLM.from_config(cfg).eval()
    d = tmp_path_factory.mktemp("tiny")
    hf.save_pretrained(d)
    llm = LLM(str(d), dtype="float32", max_model_len=96, max_num_seqs=3, progress=False)
    g = torch.Generator().manual_seed(2)
    prompts = [{"id": f"p{i}", "ids": torch.randint(0, 50, (5 + i,), generator=g).tolist()} for i in range(5)]
    return hf, llm, prompts


def _gen(llm, out, prompts, **kw):
    return generate_data(llm, str(out), prompts, sources=["test"], modes=("greedy", "sampled"), max_tokens=12,
                         shard_size=4, layers=[1, 3, 5], progress=False, **kw)


@pytest.mark.parametrize("capture", ["generation", "prefill"])
def test_captured_states_equal_hf_hidden_states(tiny, tmp_path, capture):
    """Recorded while generating (the last token, never fed, left out) or recomputed in a batched prefill."""
    hf, llm, prompts = tiny
    meta = _gen(llm, tmp_path, prompts, capture=capture)
    seqs = load_all(tmp_path)
    n = 12 - (capture == "generation")
    assert meta["capture"] == capture and meta["response_tokens"] == 10 * n
    assert len(seqs) == 10 and all(len(s.ids) == s.prompt_len + n for s in seqs)
    for s in seqs[:4]:
        with torch.no_grad():
            ref = hf(s.ids[None], output_hidden_states=True)
        for i in (1, 3, 5):  # HF's hidden_states[i] enters layer i; [L] is the last layer's output after the norm
            want = ref.hidden_states[i][0] if i < 5 else None
            if want is not None:
                torch.testing.assert_close(s.hidden[i], want, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(target_logits(s.last_hidden, hf.lm_head.weight), ref.logits[0], atol=5e-2, rtol=5e-2)
    # greedy responses are the target's own greedy continuation
    greedy = seqs[0]
    out = hf.generate(greedy.ids[None, : greedy.prompt_len], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert out[0, : greedy.prompt_len + n].tolist() == greedy.ids.tolist()


def test_interrupted_run_resumes_with_identical_shards(tiny, tmp_path):
    _, llm, prompts = tiny
    meta = _gen(llm, tmp_path, prompts)
    assert meta["shards"] == [0, 1, 2] and meta["num_sequences"] == 10
    before = load_file(str(tmp_path / shard_name(1)))
    # interruption: shard 1 lost, and shard 2 written but never recorded in meta.json
    (tmp_path / shard_name(1)).unlink()
    meta["shards"] = [0]
    write_meta(tmp_path, meta)
    again = _gen(llm, tmp_path, prompts)
    assert again["shards"] == [0, 1, 2]
    after = load_file(str(tmp_path / shard_name(1)))
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_resuming_with_other_settings_is_refused(tiny, tmp_path):
    _, llm, prompts = tiny
    _gen(llm, tmp_path, prompts[:2])
    with pytest.raises(ValueError, match="other settings"):
        generate_data(llm, str(tmp_path), prompts[:2], sources=["test"], modes=("greedy",), max_tokens=12,
                      shard_size=4, layers=[1, 3, 5], progress=False)
    assert read_meta(tmp_path)["modes"] == ["greedy", "sampled"]
    with pytest.raises(ValueError, match="capture"):  # the directory's shards were recorded while generating
        _gen(llm, tmp_path, prompts[:2], capture="prefill")
    assert _gen(llm, tmp_path, prompts[:2])["capture"] == "generation"  # auto resumes with the directory's own


@pytest.mark.parametrize("corpus", ["project", "formats"])
def test_project_corpus_does_not_reuse_benchmark_prompts(corpus):
    from verispec.bench.workloads import WORKLOADS, load_workload
    from verispec.train.corpus import project_prompts
    from verispec.train.corpus_formats import format_prompts

    def windows(text: str, n: int = 8) -> set[tuple[str, ...]]:
        w = text.lower().split()
        return {tuple(w[i : i + n]) for i in range(len(w) - n + 1)}

    bench = set()
    for name in WORKLOADS:
        for p in load_workload(name):
            bench |= windows(" ".join(m["content"] for m in p.messages))
    ours = project_prompts() if corpus == "project" else format_prompts()
    assert len(ours) >= (150 if corpus == "project" else 800) and {p["kind"] for p in ours} == set(WORKLOADS)
    assert len({p["prompt"] for p in ours}) == len(ours) and len({p["id"] for p in ours}) == len(ours)
    shared = [p["id"] for p in ours if windows(p["prompt"]) & bench]
    assert not shared, f"training prompts share an 8-word run with benchmark prompts: {shared[:5]}"


def test_format_corpus_is_added_interleaved_and_deterministic(tmp_path):
    from verispec.train.corpus import project_prompts
    from verispec.train.corpus_formats import format_prompts
    from verispec.train.data import collect_prompts

    f = tmp_path / "extra.jsonl"
    f.write_text('{"prompt": "one"}\n{"prompt": "two"}\n')
    base = collect_prompts([str(f)], None, True)
    both = collect_prompts([str(f)], None, True, formats=True)
    fmt = format_prompts()
    assert len(both) == len(base) + len(fmt)
    assert [p["id"] for p in both[:3]] == [project_prompts()[0]["id"], fmt[0]["id"], "extra-0000"]
    assert [p["messages"][0]["content"] for p in both if p["id"].startswith("verispec-fmt-")] == \
        [p["prompt"] for p in fmt]
    assert format_prompts() == fmt  # deterministic


def test_prompt_files_split_at_newlines_only(tmp_path):
    """A JSONL string may hold U+2028 (as arena-hard-v2.jsonl does): str.splitlines() would cut the line there."""
    import json

    from verispec.train.data import read_prompt_file

    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"turns": ["a\u2028b"]}, ensure_ascii=False) + "\n\n" + json.dumps({"prompt": "c"}) + "\n",
                 encoding="utf-8")
    assert [p["messages"][0]["content"] for p in read_prompt_file(str(f), None)] == ["a\u2028b", "c"]
    f.write_text('{"turns": ["x"]}\n{"turns": [\n', encoding="utf-8")
    with pytest.raises(ValueError, match="line 2: not JSON"):
        read_prompt_file(str(f), None)


def test_the_engine_is_fed_across_shards_and_a_stopped_run_resumes_to_the_same_data(tiny, tmp_path, monkeypatch):
    """Shards of 2 sequences with 3 decoding at once: requests of several shards share steps (small shards keep the
    engine full), each shard is written when its last response ends, and a run stopped by an error after its
    first shard resumes to exactly the data of an uninterrupted run."""
    import verispec.train.data as data

    _, llm, prompts = tiny
    gen = lambda out: generate_data(llm, str(out), prompts, sources=["test"], modes=("greedy", "sampled"),  # noqa
                                    max_tokens=12, shard_size=2, layers=[1, 3, 5], progress=False)
    engine, most = llm.engine, []
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (most.append(len(engine.running)), step())[1])
    gen(tmp_path / "whole")
    assert max(most) == 3 > 2, "one shard at a time would run at most 2 requests"
    monkeypatch.setattr(engine, "step", step)

    written = []
    real = data.write_shard

    def stop_after_first(path, seqs):
        if written:
            raise KeyboardInterrupt
        written.append(path)
        real(path, seqs)

    monkeypatch.setattr(data, "write_shard", stop_after_first)
    with pytest.raises(KeyboardInterrupt):
        gen(tmp_path / "stopped")
    assert read_meta(tmp_path / "stopped")["shards"] == [0] and not engine.has_work()
    monkeypatch.setattr(data, "write_shard", real)
    meta = gen(tmp_path / "stopped")
    assert meta["shards"] == [0, 1, 2, 3, 4] and meta["num_sequences"] == 10
    for i in range(5):
        a, b = load_file(str(tmp_path / "whole" / shard_name(i))), load_file(str(tmp_path / "stopped" / shard_name(i)))
        assert a.keys() == b.keys(), f"shard {i}"
        for k in a:  # tokens exactly; states to float rounding: this tiny model's fp32 linears are not batch-invariant,
            # and a resumed run batches its requests differently (shard 0's are not run again)
            if a[k].is_floating_point():
                torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-4, msg=f"shard {i} {k}")
            else:
                assert torch.equal(a[k], b[k]), f"shard {i} {k}"
