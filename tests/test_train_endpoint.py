"""`verispec train data --endpoint`: responses from an OpenAI-compatible server (here `verispec serve` of the same
tiny target, live over HTTP) give the same data as the local engine, token for token and state for state; a server
without token ids has its text re-tokenized (and counted); transient errors are retried, others stop the run;
`--part I/N` + `merge-data` give the single run's data; the batched capture equals HF's hidden states."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.helpers import live, make_app
from verispec import LLM
from verispec.execution.features import capture_many
from verispec.train import endpoint as ep
from verispec.train.data import generate_data, merge_parts, parse_part
from verispec.train.shards import load_all, read_meta

PROMPTS = [[{"role": "user", "content": t}] for t in ("Name a colour.", "Count to five.", "Say hi.", "2 + 2 = ?",
                                                    "A short poem about rain.")]


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", max_model_len=256, max_num_seqs=4, progress=False)


def prompts(llm):
    return [{"id": f"p{i}", "messages": m} for i, m in enumerate(PROMPTS)]


def gen(llm, out, **kw):
    return generate_data(llm, str(out), prompts(llm), sources=["test"], modes=("greedy", "sampled"), max_tokens=10,
                         shard_size=3, layers=[1, 2], progress=False, **kw)


def same_data(a, b) -> None:
    sa, sb = load_all(a), load_all(b)
    assert len(sa) == len(sb) == 10
    for x, y in zip(sa, sb):
        assert x.ids.tolist() == y.ids.tolist() and x.prompt_len == y.prompt_len
        torch.testing.assert_close(x.last_hidden, y.last_hidden, atol=1e-4, rtol=1e-4)  # fp32, batched differently
        for k in x.hidden:
            torch.testing.assert_close(x.hidden[k], y.hidden[k], atol=1e-4, rtol=1e-4)


def test_endpoint_responses_give_the_local_engines_data(llm, tiny_dir, tmp_path):
    gen(llm, tmp_path / "local", capture="prefill")  # the endpoint returns no states: both recomputed
    app, _ = make_app(tiny_dir, max_num_seqs=4)
    with live(app) as url:  # the app's lifespan starts and stops its engine
        remote = ep.Endpoint.connect(url + "/v1", tokenizer=llm.tokenizer, concurrency=4)
        meta = gen(llm, tmp_path / "remote", endpoint=remote)
    assert remote.retokenized == 0 and meta["responder"] == f"endpoint:{remote.model}"
    same_data(tmp_path / "local", tmp_path / "remote")
    with pytest.raises(ValueError, match="responder differ"):  # one data set never mixes responders
        gen(llm, tmp_path / "remote")


def test_connect_checks_the_served_model(tiny_dir):
    app, _ = make_app(tiny_dir)
    with live(app) as url:
        with pytest.raises(ValueError, match="does not serve 'other'"):
            ep.Endpoint.connect(url, "other")
    with pytest.raises(ValueError, match="does not answer GET /v1/models"):
        ep.Endpoint.connect("http://127.0.0.1:9")


def mock(handler) -> httpx.Client:
    return httpx.Client(transport=httpx.MockTransport(handler), base_url="http://mock")


def test_text_only_servers_are_retokenized_and_counted(llm):
    seen = []

    def handler(request):
        seen.append(request.read())
        return httpx.Response(200, json={"choices": [{"index": 0, "text": " blue sky", "finish_reason": "stop"}]})

    e = ep.Endpoint("http://mock", "m", tokenizer=llm.tokenizer)
    got = e._one(mock(handler), [1, 2, 3], "sampled", 7, 5, 0.7)
    assert got == llm.tokenizer(" blue sky", add_special_tokens=False)["input_ids"] and e.retokenized == 1
    import json

    body = json.loads(seen[0])
    assert body["prompt"] == [1, 2, 3] and body["seed"] == 7 and body["temperature"] == 0.7 and body["return_token_ids"]


def test_transient_errors_are_retried_and_others_stop(monkeypatch):
    monkeypatch.setattr(ep.time, "sleep", lambda s: None)
    calls = []

    def flaky(request):
        calls.append(1)
        if len(calls) < 3:
            return httpx.Response(503 if len(calls) == 1 else 429, text="busy")
        return httpx.Response(200, json={"choices": [{"text": "x", "token_ids": [4, 5]}]})

    e = ep.Endpoint("http://mock", "m")
    assert e._one(mock(flaky), [1], "greedy", 0, 2, 0.7) == [4, 5] and len(calls) == 3
    with pytest.raises(ValueError, match=r"refused a request \(400\): bad prompt"):
        e._one(mock(lambda r: httpx.Response(400, text="bad prompt")), [1], "greedy", 0, 2, 0.7)
    with pytest.raises(ValueError, match="failed 5 times"):
        e._one(mock(lambda r: httpx.Response(502)), [1], "greedy", 0, 2, 0.7)


def test_parts_merged_equal_the_single_run(llm, tmp_path):
    gen(llm, tmp_path / "whole")
    for i in range(3):
        m = gen(llm, tmp_path / f"part{i}", part=(i, 3))
        assert m["shards"] == [s for s in range(4) if s % 3 == i]
    merged = merge_parts(str(tmp_path / "merged"), [str(tmp_path / f"part{i}") for i in range(3)])
    assert merged["shards"] == [0, 1, 2, 3] and merged["num_sequences"] == 10
    same_data(tmp_path / "whole", tmp_path / "merged")
    assert read_meta(tmp_path / "merged")["response_tokens"] == read_meta(tmp_path / "whole")["response_tokens"]
    with pytest.raises(ValueError, match="shard 0 is in both"):
        merge_parts(str(tmp_path / "twice"), [str(tmp_path / "part0"), str(tmp_path / "whole")])
    generate_data(llm, str(tmp_path / "other"), prompts(llm), sources=["test"], modes=("greedy",), max_tokens=10,
                  shard_size=3, layers=[1, 2], progress=False, part=(1, 3))
    with pytest.raises(ValueError, match="different settings"):
        merge_parts(str(tmp_path / "mixed"), [str(tmp_path / "part0"), str(tmp_path / "other")])
    # parts of both capture modes join: each part's sequences as it wrote them (a prefill-captured response keeps
    # its last token's state, a generation-captured one leaves that token out)
    gen(llm, tmp_path / "pre0", part=(0, 3), capture="prefill")
    both = merge_parts(str(tmp_path / "both"), [str(tmp_path / d) for d in ("pre0", "part1", "part2")])
    assert both["capture"] == "mixed" and both["shards"] == [0, 1, 2, 3]
    parts = {d: load_all(tmp_path / d) for d in ("pre0", "part1", "part2")}
    expect = parts["pre0"][:3] + parts["part1"] + parts["part2"] + parts["pre0"][3:]  # shards 0, 1, 2, 3
    got = load_all(tmp_path / "both")
    assert len(got) == 10 and [len(x.ids) for x in got] == [len(x.ids) for x in expect]
    assert any(len(a.ids) == len(b.ids) + 1 for a, b in zip(parts["pre0"], load_all(tmp_path / "part0")))
    for x, y in zip(got, expect):
        assert torch.equal(x.ids, y.ids) and torch.equal(x.hidden[2], y.hidden[2])
    with pytest.raises(ValueError, match="different capture modes"):
        gen(llm, tmp_path / "both")
    assert parse_part("2/4") == (2, 4)
    for bad in ("4/4", "x", "1/0"):
        with pytest.raises(ValueError, match="--part"):
            parse_part(bad)


def test_batched_capture_equals_hf_hidden_states(llm, hf):
    g = torch.Generator().manual_seed(4)
    seqs = [torch.randint(0, 200, (n,), generator=g).tolist() for n in (5, 17, 3, 40, 9)]
    got = capture_many(llm.model, seqs, [0, 1], max_tokens=30)  # groups: (5, 17, 3), (40) alone, (9)
    for ids, (hidden, last) in zip(seqs, got):
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states
        for k in (0, 1):  # entering layer k (HF's last entry is after the final norm: our last_hidden)
            torch.testing.assert_close(hidden[k], ref[k][0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(last, ref[-1][0], atol=1e-4, rtol=1e-4)


def test_different_data_sets_mix_into_one_training_directory(llm, tmp_path):
    import json
    import shutil

    from verispec.train.mix import mix_sets
    from verispec.train.share import catalog

    gen(llm, tmp_path / "a")  # 10 sequences, greedy and sampled, layers 1 and 2
    generate_data(llm, str(tmp_path / "b"), prompts(llm)[:2], sources=["other"], modes=("greedy",), max_tokens=6,
                  shard_size=3, layers=[1], progress=False)
    meta = mix_sets(tmp_path / "mix", [tmp_path / "a", tmp_path / "b"])
    a, b, got = load_all(tmp_path / "a"), load_all(tmp_path / "b"), load_all(tmp_path / "mix")
    assert len(a) == 10 and len(b) == 2 and len(got) == 12 and len(catalog(tmp_path / "mix")) == 12
    for x, y in zip(got, a + b):  # a's shards, then b's, sequence for sequence
        assert torch.equal(x.ids, y.ids) and x.prompt_len == y.prompt_len and torch.equal(x.hidden[1], y.hidden[1])
    ma, mb = read_meta(tmp_path / "a"), read_meta(tmp_path / "b")
    assert meta["layers"] == [1] and meta["sources"] == ["test", "other"] and meta["modes"] == ["greedy", "sampled"]
    assert meta["response_tokens"] == ma["response_tokens"] + mb["response_tokens"]
    assert meta["shards"] == [0, 1, 2, 3, 4]
    assert read_meta(tmp_path / "mix") == meta
    with pytest.raises(ValueError, match="not extended"):
        gen(llm, tmp_path / "mix")
    with pytest.raises(ValueError, match="not empty"):
        mix_sets(tmp_path / "mix", [tmp_path / "a", tmp_path / "b"])
    shutil.copytree(tmp_path / "a", tmp_path / "c")  # the same shards, said to come from a wider target
    mc = {**ma, "hidden_size": ma["hidden_size"] * 2}
    (tmp_path / "c" / "meta.json").write_text(json.dumps(mc))
    with pytest.raises(ValueError, match="differ in hidden_size"):
        mix_sets(tmp_path / "mix2", [tmp_path / "a", tmp_path / "c"])
    assert not (tmp_path / "mix2").exists()
