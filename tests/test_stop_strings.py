"""Stop strings (`SamplingParams(stop=...)`, OpenAI's `stop`) in the engine, the Python API and the server.

Oracle: plain greedy decoding with NO stop strings, decoded to text by the tokenizer, then cut at the first place
its text contains a stop string (plain `str.find`, and a brute-force scan for the token count); never the
engine's own matcher. Models: a tiny Llama whose greedy output cycles through the tokens of one sentence (so the
n-gram and suffix drafters have their drafts accepted and stop strings end inside accepted blocks), and the tiny
random Llama of conftest.py (text with partial UTF-8 tokens), both with the default model's tokenizer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import live, make_app
from verispec import LLM, SamplingParams
from verispec.engine.stops import StopMatcher, first_stop, partial_stop_len
from verispec.server.responses import IncrementalText

SENTENCE = "The quick brown fox jumps over a lazy dog, café! 🦊\n"  # 16 distinct tokens; the fox is 3 byte tokens
MAX_TOKENS = 40
# each straddles token boundaries; the first occurrences end at different positions of the speculative blocks
STOPS = ["ck brown f", "s over a l", "dog, caf", "é! 🦊\nThe q", "🦊", "\n", "x jumps", "zy d",
         "over a lazy dog, café! 🦊\nThe quick brown fox jumps o"]
SPEC = {"ngram": {"method": "ngram", "num_speculative_tokens": 4},
        "suffix": {"method": "suffix", "num_speculative_tokens": 4}}


# ---- the models ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cycle_dir(tiny_dir: Path, tok, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Llama whose greedy next token after SENTENCE's token i is its token i + 1 (cyclically): the layers
    add nothing (zero output projections), the cycle tokens' embeddings are orthogonal and lm_head maps each to
    the next."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cycle = tok(SENTENCE, add_special_tokens=False)["input_ids"]
    assert len(set(cycle)) == len(cycle) <= 32
    cfg = LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=1,
                      eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    m = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        m.lm_head.weight.zero_()
        for i, t in enumerate(cycle):
            m.model.embed_tokens.weight[t] = 10 * torch.eye(32)[i]
            m.lm_head.weight[cycle[(i + 1) % len(cycle)]] = 10 * torch.eye(32)[i]
    out = tmp_path_factory.mktemp("cycle-llama")
    m.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def cycle_llm(cycle_dir: Path) -> LLM:
    return LLM(str(cycle_dir), dtype="float32", device="cpu", progress=False, max_model_len=128, scheduler="static")


@pytest.fixture(scope="module")
def prompt_ids(tok) -> list[int]:
    return tok(SENTENCE, add_special_tokens=False)["input_ids"]  # the drafters find the cycle in the prompt


def reference(llm: LLM, prompt_ids: list[int], max_tokens: int = MAX_TOKENS) -> tuple[list[int], str]:
    """Plain greedy decoding, no stop strings: the tokens and their text."""
    plain = llm.with_speculation(None)
    out = plain.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                          ignore_eos=True), use_tqdm=False)[0]
    return out.token_ids, out.text


def cut(tok, ids: list[int], text: str, stops: list[str], include: bool) -> tuple[list[int], str, str]:
    """The reference cut: the text up to the first place it contains a stop string (the one ending first), and the
    fewest tokens whose decoded text holds it."""
    end, _, stop = min((text.find(s) + len(s), -len(s), s) for s in stops if s in text)
    n = next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n], skip_special_tokens=True)[:end] == text[:end])
    return ids[:n], text[:end] if include else text[: end - len(stop)], stop


def check(outs, tok, ref_ids, ref_text, stops_list, include):
    for out, stops in zip(outs, stops_list):
        ids, text, stop = cut(tok, ref_ids, ref_text, stops, include)
        assert (out.text, out.token_ids) == (text, ids), f"stop={stops!r} include={include}"
        assert (out.finish_reason, out.stop_reason) == ("stop", stop)
        assert out.stats["output_tokens"] == len(ids)


# ---- the pure matcher ------------------------------------------------------------------------------------------
def test_matcher_across_commits_and_tokens():
    toks = ["ab", "cd", "ef", "gh", "ij"]
    join = "".join
    m = StopMatcher(["def"], False, lambda ids: join(toks[i] for i in ids))
    assert m.update([0, 1], 2) is None  # "abcd": "d" could start it, nothing ends yet
    hit = m.update([0, 1, 2, 3], 2)  # "abcdefgh": "def" straddles the previous commit and ends in token 2
    assert (hit.keep_tokens, hit.text, hit.stop) == (3, "abc", "def")
    m = StopMatcher(["cdefg", "e"], True, lambda ids: join(toks[i] for i in ids))
    hit = m.update([0, 1, 2, 3, 4], 5)  # "e" ends first although "cdefg" starts first
    assert (hit.keep_tokens, hit.text, hit.stop) == (3, "abcde", "e")
    assert first_stop("xxabcab", ["ab", "cab"]) == (2, "ab")
    assert first_stop("xbc", ["abc", "bc"], 0) == (1, "bc") and first_stop("xyz", ["q"]) is None
    assert first_stop("zabc", ["abc", "bc"]) == (1, "abc")  # same end: the longer one


def test_partial_stop_len_and_incremental_text_hold_back():
    assert partial_stop_len("hello wor", ["world", "or"]) == 3
    assert partial_stop_len("hello", ["world"]) == 0 and partial_stop_len("abc", ["c"]) == 0
    chars = "say abXab! abXYZ then"
    text = IncrementalText(lambda ids: "".join(chars[i] for i in ids), hold=["abXYZ"])
    sent, held_seen = "", False
    for n in range(1, len(chars) + 1):
        sent += text.update(list(range(n)), final=False)
        held = chars[:n][len(sent):]
        assert chars[:n].startswith(sent) and (held == "" or "abXYZ".startswith(held))
        held_seen |= len(held) >= 3
    assert held_seen and sent == chars


def test_sampling_params_take_a_string_or_a_list():
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    for bad in ([""], "", [1], ["a", None]):
        with pytest.raises(ValueError, match="stop must be"):
            SamplingParams(stop=bad)
    with pytest.raises(ValueError, match="include_stop_str_in_output"):
        SamplingParams(stop="x", include_stop_str_in_output="yes")


# ---- the engine through LLM.generate ---------------------------------------------------------------------------
@pytest.mark.parametrize("method", ["none", "ngram", "suffix", "draft_model"])
@pytest.mark.parametrize("include", [False, True])
def test_greedy_output_with_stop_strings_is_the_plain_output_cut(cycle_llm, cycle_dir, tok, prompt_ids, method,
                                                                 include):
    ref_ids, ref_text = reference(cycle_llm, prompt_ids)
    assert ref_text.startswith(SENTENCE) and len(ref_ids) == MAX_TOKENS
    draft = {"method": "draft_model", "num_speculative_tokens": 4, "model": str(cycle_dir)}  # the target itself
    llm = cycle_llm.with_speculation({"none": None, "draft_model": draft, **SPEC}[method])
    stops_list = [[s] for s in STOPS] + [["zy d", "ck brown f"], ["quick brown fox", "brown"]]  # the earliest wins
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=s, include_stop_str_in_output=include)
              for s in stops_list]
    outs = llm.generate([{"prompt_token_ids": prompt_ids}] * len(params), params, use_tqdm=False)
    check(outs, tok, ref_ids, ref_text, stops_list, include)
    assert outs[-1].text == ("The quick brown" if include else "The quick ")
    trimmed = [o.stats["stop_trimmed_tokens"] for o in outs]
    if method == "none":
        assert not any(trimmed)  # one token per step: nothing follows the completing token
    else:  # tokens accepted after the stop string were dropped: it ended inside an accepted draft block
        assert sum(o.stats["num_accepted_tokens"] for o in outs) > 0
        assert sum(t > 0 for t in trimmed) >= 3, trimmed
    assert llm.engine.kv_tokens() == 0 and not llm.engine.running


@pytest.mark.parametrize("method", ["none", "draft_model"])
def test_random_model_with_partial_utf8_tokens(tiny_dir, tok, method):
    """Random text with byte tokens that decode to U+FFFD alone; the draft model is the target (all accepted)."""
    spec = None if method == "none" else {"method": "draft_model", "num_speculative_tokens": 4, "model": str(tiny_dir)}
    llm = LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False, max_model_len=128, scheduler="static",
              speculative_config=spec)
    prompt = tok("def f(x):")["input_ids"]
    ref_ids, ref_text = reference(llm, prompt)
    assert "\ufffd" in ref_text  # the case this test is for
    bounds = [len(tok.decode(ref_ids[:n], skip_special_tokens=True)) for n in range(1, len(ref_ids))]
    stops = [ref_text[b - 2 : b + 3] for b in bounds[2::4] if "\ufffd" not in ref_text[b - 2 : b + 3]]
    assert len(stops) >= 4
    for include in (False, True):
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[s],
                                 include_stop_str_in_output=include) for s in stops]
        outs = llm.generate([{"prompt_token_ids": prompt}] * len(stops), params, use_tqdm=False)
        check(outs, tok, ref_ids, ref_text, [[s] for s in stops], include)


def test_a_stop_string_that_never_occurs_changes_nothing(cycle_llm, prompt_ids):
    ref_ids, ref_text = reference(cycle_llm, prompt_ids)
    llm = cycle_llm.with_speculation(SPEC["ngram"])
    out = llm.generate({"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                        stop=["fox jumpz", "🦊🦊"]), use_tqdm=False)[0]
    assert (out.text, out.token_ids, out.finish_reason, out.stop_reason) == (ref_text, ref_ids, "length", None)
    assert out.outputs[0].stop_reason is None and out.stats["stop_trimmed_tokens"] == 0


def test_stop_strings_without_a_tokenizer_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=60, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
                     ).save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", device="cpu", progress=False, scheduler="static")
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(stop=["a"]), use_tqdm=False)
    assert llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids


# ---- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(cycle_dir: Path):
    from fastapi.testclient import TestClient

    app, _ = make_app(cycle_dir, SPEC["ngram"])
    with TestClient(app) as client:
        yield app, client


def sse_choices(text: str) -> list[dict]:
    events = [e[6:] for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "[DONE]"
    return [c for e in events[:-1] for c in json.loads(e)["choices"]]


# with 5-token commits: "s over a l" straddles the commit that ends with " over" (the tail "s over" must wait, then
# is cut); "fox jumpz" never completes, but a commit ends with " fox" (that tail must wait, then go out)
HOLDS = ("s over a l", "fox jumpz")


@pytest.mark.parametrize("stop,include", [("ck brown f", False), (["zy d", "x jumps"], False), ("é! 🦊\nThe q", True),
                                          ("s over a l", False), ("fox jumpz", False)])
def test_server_completion_stream_and_not(server, cycle_llm, tok, prompt_ids, stop, include):
    _, client = server
    ref_ids, ref_text = reference(cycle_llm, prompt_ids)
    stops = [stop] if isinstance(stop, str) else stop
    body = {"prompt": prompt_ids, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": stop,
            "include_stop_str_in_output": include, "return_token_ids": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    if any(s in ref_text for s in stops):
        ids, text, matched = cut(tok, ref_ids, ref_text, stops, include)
        assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", matched)
    else:
        ids, text = ref_ids, ref_text
        assert (choice["finish_reason"], choice["stop_reason"]) == ("length", None)
    assert (choice["text"], choice["token_ids"], usage["completion_tokens"]) == (text, ids, len(ids))
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    chunks = sse_choices(r.text)
    streamed, got_ids, held_back = "", [], False
    for c in chunks:
        streamed += c["text"]
        got_ids += c["token_ids"]
        if c["finish_reason"] is None:  # what is decoded but not yet sent may only be a stop string's start
            held = tok.decode(got_ids, skip_special_tokens=True)[len(streamed):]
            assert held == "" or held.endswith("\ufffd") or (not include and any(s.startswith(held) for s in stops))
            held_back |= held != "" and not held.endswith("\ufffd")
    assert (streamed, got_ids) == (text, ids)
    assert (chunks[-1]["finish_reason"], chunks[-1]["stop_reason"]) == (choice["finish_reason"], choice["stop_reason"])
    assert held_back == (stop in HOLDS)  # a tail that could start a stop string waited until it was resolved


def test_server_chat_with_stop(server, cycle_llm, tok):
    _, client = server
    msgs = [{"role": "user", "content": "Hi"}]
    ref = cycle_llm.with_speculation(None).chat(msgs, SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                                use_tqdm=False)[0]
    assert "\n" in ref.text
    want = ref.text[: ref.text.find("\n")]
    body = {"messages": msgs, "max_tokens": MAX_TOKENS, "temperature": 0, "stop": "\n"}
    r = client.post("/v1/chat/completions", json=body).json()
    assert (r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) == (want, "stop")
    assert r["choices"][0]["stop_reason"] == "\n"
    chunks = sse_choices(client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert "".join(c["delta"].get("content") or "" for c in chunks) == want
    assert r["usage"]["completion_tokens"] == len(cut(tok, ref.token_ids, ref.text, ["\n"], False)[0])


def test_openai_client_stop_newline(cycle_dir, cycle_llm):
    openai = pytest.importorskip("openai")
    ref = cycle_llm.with_speculation(None).generate("The quick", SamplingParams(temperature=0, max_tokens=30),
                                                    use_tqdm=False)[0]
    assert "\n" in ref.text
    want = ref.text[: ref.text.find("\n")]
    app, _ = make_app(cycle_dir, SPEC["suffix"])
    with live(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        model = client.models.list().data[0].id
        comp = client.completions.create(model=model, prompt="The quick", max_tokens=30, temperature=0, stop=["\n"])
        assert (comp.choices[0].text, comp.choices[0].finish_reason) == (want, "stop")
        parts = [c.choices[0].text for c in client.completions.create(
            model=model, prompt="The quick", max_tokens=30, temperature=0, stop=["\n"], stream=True) if c.choices]
        assert "".join(parts) == want
