"""Streamed tool calls (server/tools.py ToolCallStream) against the non-streamed parser, tools.parse_output, run on
the whole text as the independent reference: the same outputs cut into pieces at every split point, at random
(fixed seeds) and a character at a time must give the same content and the same calls (name, json.loads of the
joined argument fragments), with OpenAI's delta shapes (a call's header once and first, then only its argument
fragments) and the same finish_reason. Then what the stream may not hold back (a name once whole, arguments as they
come), the documented places where a stream cannot agree with parse_output, ResponseBuilder's chunks, and end to
end: the `openai` client streaming a `tool_choice: "required"` request from the live test server gets arguments that
validate against the function's schema and equal the non-streamed response to the same request."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import jsonschema
import pytest

from tests.helpers import ASK, TIME, WEATHER, live, make_app
from verispec.tool_stream import ToolCallStream
from verispec.tools import END, START, ToolSpec, parse_output

CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)  # a block by its first end tag (the tests' own reading)

# ---- replaying a text through the stream -------------------------------------------------------------------------


def stream(text: str, cuts: list[int], finish: str = "stop") -> tuple[list[list[dict]], str | None]:
    """The deltas of each feed (the text cut at `cuts`), the finish's last, and the finish_reason."""
    p, out, prev = ToolCallStream(), [], 0
    for c in [*sorted(cuts), len(text)]:
        out.append(p.feed(text[prev:c]))
        prev = c
    tail, reason = p.finish(finish)
    return [*out, tail], reason


def assemble(steps: list[list[dict]]) -> tuple[str, list[tuple[str, str]]]:
    """Content and (name, arguments text) per call, checking each delta's shape as OpenAI's clients read it."""
    content, calls = "", []
    for delta in (d for step in steps for d in step):
        assert len(delta) == 1, delta
        if "content" in delta:
            assert isinstance(delta["content"], str) and delta["content"], delta
            content += delta["content"]
            continue
        (call,) = delta["tool_calls"]
        fn = call["function"]
        if "id" in call:  # a header: the next index, its name whole, no arguments yet
            assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function", call
            assert call["index"] == len(calls) and call["id"].startswith("call_"), call
            assert set(fn) == {"name", "arguments"} and fn["arguments"] == "" and isinstance(fn["name"], str), call
            calls.append((fn["name"], ""))
        else:  # a fragment: only arguments, of the latest call
            assert set(call) == {"index", "function"} and set(fn) == {"arguments"}, call
            assert calls and call["index"] == len(calls) - 1 and fn["arguments"], call
            calls[-1] = (calls[-1][0], calls[-1][1] + fn["arguments"])
    return content, calls


def reference(text: str) -> tuple[str, list[tuple[str, Any]]]:
    content, calls = parse_output(text)
    return content or "", [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def loaded(got: tuple[str, list[tuple[str, str]]]) -> tuple[str, list[tuple[str, Any]]]:
    return got[0], [(name, json.loads(args)) for name, args in got[1]]


def chunkings(text: str, seed: int, every: bool = True, randoms: int = 40) -> list[list[int]]:
    """Cut points: none, each single split point, a character at a time, and random cuts."""
    rng = random.Random(seed)
    out = [[], list(range(1, len(text)))]
    if every:
        out += [[k] for k in range(len(text) + 1)]
    for _ in range(randoms):
        out.append(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))) if len(text) > 1 else [])
    return out


def agrees(text: str, seed: int = 0, every: bool = True, randoms: int = 40) -> None:
    want = reference(text)
    reason = "tool_calls" if want[1] else "stop"
    for cuts in chunkings(text, seed, every, randoms):
        steps, got_reason = stream(text, cuts)
        assert loaded(assemble(steps)) == want, (text, cuts)
        assert got_reason == reason


# ---- outputs the stream must read as parse_output does ----------------------------------------------------------


def block(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


WEATHER_CALL = block('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}')
TRICKY = ('{"name": "search", "arguments": {"q": "a {b} [c] \\"d\\" \\\\ e\\n\\t \\u00e9 \\ud83d\\ude00 é }}]]",'
          ' "nested": {"x": [1, -2.5e-3, true, false, null, {}, [], {"y": {"z": ["}", "{", "\\"}"]}}]},'
          ' "tag": "<tool_call> inside a string", "half": "</tool_cal", "empty": ""}}')
CASES = {
    "one call": WEATHER_CALL,
    "content before and between calls": "Let me check the weather.\n" + WEATHER_CALL + "\nand the time:\n\n"
                                        + block('{"name": "get_time", "arguments": {"zone": "CET"}}') + "\nDone.",
    "parallel calls as the grammar writes them": block('{"name":"a","arguments":{}}') + "\n"
                                                 + block('{"name":"b","arguments":{"x":1}}') + "\n"
                                                 + block('{"name":"c","arguments":{"s":"}"}}'),
    "nested objects, braces, quotes and escapes in strings": "Searching: " + block(TRICKY),
    "arguments before name": block('{"arguments": {"a": [1, {"b": "}"}], "c": "\\""}, "name": "f"}'),
    "parameters instead of arguments": block('{"name": "f", "parameters": {"p": [true]}}'),
    "parameters and arguments": block('{"parameters": {"p": 1}, "name": "f", "arguments": {"a": 2}}'),
    "no arguments": block('{"name": "f"}'),
    "scalar arguments": block('{"name": "s", "arguments": "text {with} \\"braces\\""}') + block(
        '{"name": "n", "arguments": -12.5e3}') + block('{"name": "t", "arguments": true}') + block(
        '{"name": "z", "arguments": null}') + block('{"name": "l", "arguments": [1, [2, "]"]]}'),
    "compact": '<tool_call>{"name":"f","arguments":{"a":{"b":[]}}}</tool_call>',
    "spaced": '<tool_call>  \n\t{ \n "name" :\t"f" ,\r\n  "arguments" : { "a" : [ 1 , 2 ] }  \n}  \n\n</tool_call>',
    "escaped name and key": block('{"n\\u0061me": "get_\\u0077eather", "arguments": {"k": 1}}'),
    "extra keys": block('{"id": 7, "name": "f", "meta": {"x": "}"}, "arguments": {"a": 1}, "more": [null]}'),
    "tag-like content": "a < b, <tool_ c, <tool_calls>, </tool_call>, <tool_call\n" + WEATHER_CALL + " then <",
    "partial tag at the end": "x " + WEATHER_CALL + " <tool_ca",
    "malformed blocks among calls": "intro\n" + WEATHER_CALL + block("not json at all") + "mid "
                                    + block('{"name": 3, "arguments": {"a": 1}}')
                                    + block('{"arguments": {"a": "x"}}') + block('["get_weather"]') + block("")
                                    + "<tool_call></tool_call>" + block('{"name": "last", "arguments": {}}') + " end",
    "nameless block with the end tag in a string": WEATHER_CALL + block('{"arguments": {"a": "</tool_call>"}}')
                                                    + "tail",
    "content only": "  Hello,\n  world <b>{not a call}</b>  \n\n",
    "empty": "",
    "whitespace only": " \n\t ",
}


@pytest.mark.parametrize("name", list(CASES))
def test_every_chunking_gives_what_parse_output_gives(name):
    agrees(CASES[name], seed=len(name))


def test_cases_hold_what_they_say():
    """The references above are what the names say (guards the cases from testing nothing)."""
    assert len(reference(CASES["content before and between calls"])[1]) == 2
    assert reference(CASES["content before and between calls"])[0] == ("Let me check the weather.\n\nand the time:"
                                                                         "\n\n\nDone.")
    assert reference(CASES["nested objects, braces, quotes and escapes in strings"])[1][0][1]["nested"]["x"][-1] \
        == {"y": {"z": ["}", "{", '"}']}}
    assert [n for n, _ in reference(CASES["malformed blocks among calls"])[1]] == ["get_weather", "last"]
    assert reference(CASES["escaped name and key"])[1] == [("get_weather", {"k": 1})]
    assert reference(CASES["parameters and arguments"])[1] == [("f", {"a": 2})]
    assert reference(CASES["nameless block with the end tag in a string"])[0].endswith('"}}\n</tool_call>tail')


# ---- random outputs ----------------------------------------------------------------------------------------------

ALPHABET = 'ab {}[]":,\\/<>\n\té😀_-01'
WORDS = ["Sure", " ", "\n", "<", "<tool", "_call", "call>", "</tool_call>", "{", "}", "é", "ok.", '"', "tool_call"]


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 8)))


def random_value(rng: random.Random, depth: int) -> Any:
    kind = rng.choice(["str", "num", "const", "obj", "arr"] if depth < 3 else ["str", "num", "const"])
    if kind == "str":
        return random_string(rng)
    if kind == "num":
        return rng.choice([0, -7, 3.25, 1e-5, 12345678901234])
    if kind == "const":
        return rng.choice([True, False, None])
    if kind == "obj":
        return {random_string(rng) if rng.random() < .3 else f"k{i}": random_value(rng, depth + 1)
                for i in range(rng.randint(0, 3))}
    return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def random_output(rng: random.Random) -> str:
    parts = []
    for _ in range(rng.randint(1, 5)):
        if rng.random() < 0.5:
            parts.append("".join(rng.choice(WORDS) for _ in range(rng.randint(0, 6))))
            continue
        obj = {"name": rng.choice(["f", "get_weather", "a-b_c"]), "arguments": random_value(rng, 0)}
        if rng.random() < 0.3:
            obj = {"arguments": obj["arguments"], "name": obj["name"]}
        body = json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, None, 0, 2]),
                          separators=rng.choice([None, (",", ":"), (", ", ": ")]))
        parts.append(rng.choice(["<tool_call>\n{}\n</tool_call>", "<tool_call>{}</tool_call>"]).format(body))
    text = "".join(parts)
    return text.lstrip()  # leading whitespace before content before a call: see the documented differences


def test_random_outputs_in_random_pieces():
    rng, n = random.Random(1234), 0
    while n < 150:
        text = random_output(rng)
        blocks = CALL.findall(text)
        if text.count(START) != len(blocks) or any(END in json.dumps(b) for b in blocks):
            continue  # the words made a stray tag, or an end tag in a string (CALL's count would be off)
        agrees(text, seed=n, every=False, randoms=6)
        n += 1


# ---- what the stream may not hold back --------------------------------------------------------------------------


def test_the_header_goes_out_once_the_name_is_whole_and_arguments_as_they_come():
    text = "Ok " + WEATHER_CALL
    name_end = text.index('"get_weather"') + len('"get_weather"')
    args = '{"city": "Paris", "unit": "celsius"}'
    a0 = text.index(args)
    p, steps = ToolCallStream(), []
    for k, ch in enumerate(text, 1):
        steps.append(p.feed(ch))
        content, calls = assemble(steps)
        assert (len(calls) == 1) == (k >= name_end), k
        if calls:
            assert calls[0][1] == args[: max(0, min(k, a0 + len(args)) - a0)], k  # nothing held back
    assert content == "Ok"  # the space before the block waits, and goes at the end (parse_output strips it)


def test_content_holds_back_only_a_possible_tag_and_whitespace():
    text = "Hi <b> and <tool_x, <tool_cal.\n\n Bye <tool_c"
    p, steps = ToolCallStream(), []
    for k, ch in enumerate(text, 1):
        steps.append(p.feed(ch))
        sent = assemble(steps)[0]
        rest = text[len(sent):k]
        assert text.startswith(sent), k
        assert rest.strip() == "" or START.startswith(rest.lstrip()), (k, rest)
    assert assemble([*steps, p.finish("stop")[0]])[0] == text


# ---- finish_reason and a stop at "length" -------------------------------------------------------------------------


@pytest.mark.parametrize("text, finish, want", [
    ("plain", "stop", "stop"), (WEATHER_CALL, "stop", "tool_calls"), (WEATHER_CALL, "length", "length"),
    ("plain", "length", "length"), (block("nope"), "stop", "stop"), (WEATHER_CALL, "abort", "abort")])
def test_finish_reason(text, finish, want):
    assert stream(text, [3], finish)[1] == want
    assert parse_output(text)[1] or want == finish  # the non-streamed rule: "tool_calls" only with calls


BEFORE = "First " + WEATHER_CALL + "\nthen "


@pytest.mark.parametrize("partial, sent", [
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "C', ("get_time", '{"zone": "C')),
    ('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}', ("get_time", '{"zone": "CET"}')),
    ('<tool_call>\n{"name": "get_time"', ("get_time", "")),
    ('<tool_call>\n{"name": "get_ti', None),
    ('<tool_call>\n{"arguments": {"zone": "CET"}, "na', None),
    ("<tool_call>\n", None),
])
def test_length_mid_call(partial, sent):
    """Cut by max_tokens inside a block: the complete calls and content are parse_output's of the text before the
    block, the unfinished block's text is dropped, and a call whose header went out keeps what it sent."""
    text = BEFORE + partial
    content, calls = reference(BEFORE)
    for cuts in chunkings(text, 7, randoms=20):
        steps, reason = stream(text, cuts, "length")
        got = assemble(steps)
        assert reason == "length"
        assert got[0] == content and loaded((got[0], got[1][:1])) == (content, calls), cuts
        assert got[1][1:] == ([sent] if sent else []), cuts


# ---- where a stream cannot agree with parse_output (documented in ToolCallStream) ------------------------------


def test_malformed_blocks_are_dropped_even_without_a_call():
    """parse_output returns the whole text as content where no block is a call; the stream, which cannot know that
    in time, drops the malformed blocks all the same."""
    text = "Here: " + block("not json") + " and " + block('{"name": 1}') + " end"
    assert parse_output(text) == (text, [])
    for cuts in chunkings(text, 3, randoms=10):
        steps, reason = stream(text, cuts)
        assert assemble(steps) == (CALL.sub("", text), []) and reason == "stop"


def test_end_tag_inside_a_json_string_is_string_text():
    """The scanner reads strings, so "</tool_call>" in an argument does not end the block: the call is the block's
    JSON (read here by json's own raw_decode), as parse_output reads it (next test)."""
    body = '{"name": "echo", "arguments": {"text": "say </tool_call> then {\\"x\\": 1}", "n": [1]}}'
    text = "Sure.\n" + block(body) + "\nDone."
    obj, _ = json.JSONDecoder().raw_decode(body)
    for cuts in chunkings(text, 5, randoms=20):
        steps, reason = stream(text, cuts)
        assert loaded(assemble(steps)) == ("Sure.\n\nDone.", [("echo", obj["arguments"])]) and reason == "tool_calls"


def test_end_tag_inside_a_json_string_agrees_with_parse_output():
    """Both read a `</tool_call>` inside a JSON string as string text: the call is kept, whole."""
    agrees(block('{"name": "echo", "arguments": {"text": "</tool_call>"}}'), every=False, randoms=2)


def test_leading_whitespace_before_content_before_a_call():
    """Content goes out before the stream knows a call will follow, so its leading whitespace does too, where
    parse_output strips it; the rest is the same."""
    text = "\n\nLet me look.\n" + WEATHER_CALL
    got, want = loaded(assemble(stream(text, [5, 30])[0])), reference(text)
    assert got[0] == "\n\n" + want[0] and got[1] == want[1]


def test_a_fault_after_the_header_stops_that_calls_arguments():
    """A raw newline in a string (no JSON has one) after the header went out: the arguments stop before it, the
    block ends at its first </tool_call>, and what follows is content again."""
    text = '<tool_call>\n{"name": "f", "arguments": {"a": "x\n</tool_call>\nafter <b>'
    for cuts in chunkings(text, 11, randoms=10):
        steps, reason = stream(text, cuts)
        assert assemble(steps) == ("after <b>", [("f", '{"a": "x')]) and reason == "tool_calls"


# ---- ResponseBuilder's chunks --------------------------------------------------------------------------------------


def test_response_builder_streams_one_chunk_per_delta_and_keeps_token_ids():
    from verispec.sampling import SamplingParams
    from verispec.server.protocol import ParsedRequest
    from verispec.server.responses import ResponseBuilder

    spec = ToolSpec(({"type": "function", "function": {"name": "get_weather", "parameters": {}}},), "auto")
    req = ParsedRequest("chat", [1, 2], SamplingParams(), True, False, True, tools=spec)
    b = ResponseBuilder(req, "m")
    text = "Ok.\n" + WEATHER_CALL
    pieces = [text[i:i + 7] for i in range(0, len(text), 7)]
    chunks = []
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        sse = b.delta_chunk(piece, [k], "stop" if last else None)
        chunks += [json.loads(line[len("data: "):]) for line in sse.split("\n\n") if line]
    choices = [c["choices"][0] for c in chunks]
    assert [t for c in choices for t in c["token_ids"]] == list(range(len(pieces))), "no step's ids lost"
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["tool_calls"]
    assert choices[-1]["delta"] == {}
    content, calls = assemble([[c["delta"] for c in choices if c["delta"]]])
    assert loaded((content, calls)) == reference(text)
    whole = b.response(text, [0], "stop")["choices"][0]  # the non-streamed response, as before
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Ok."
    assert json.loads(whole["message"]["tool_calls"][0]["function"]["arguments"]) == json.loads(calls[0][1])


# ---- end to end: the openai client and the live test server ---------------------------------------------------------



@pytest.fixture(scope="module")
def served(tiny_dir):
    openai = pytest.importorskip("openai")
    app, _ = make_app(tiny_dir, {"method": "ngram", "num_speculative_tokens": 4})
    with live(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        yield client, client.models.list().data[0].id


def test_openai_client_streams_required_calls_equal_to_the_whole_response(served):
    """Greedy and seeded requests, streamed and not: the same finish_reason, the whole response's calls streamed with
    equal arguments, which validate against their function's schema. Some seeds end at max_tokens inside a block:
    the whole response shows that block's text as content (parse_output), the stream drops it but keeps the call
    whose header went out; replaying that content through ToolCallStream must give exactly that."""
    client, model = served
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    finished = split = 0
    for seed, temperature in [(None, 0.0), (0, 1.0), (1, 1.0), (3, 1.0), (4, 1.0)]:
        kw = {"model": model, "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
              "max_tokens": 70, "temperature": temperature, "seed": seed}
        whole = client.chat.completions.create(**kw).choices[0]
        calls, fragments, content, finish = [], [], "", None
        for chunk in client.chat.completions.create(**kw, stream=True):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                for d in ch.delta.tool_calls or []:
                    if d.id is not None:  # a header: once per call, in order, its name whole
                        assert d.index == len(calls) and d.type == "function" and d.function.arguments == ""
                        calls.append((d.function.name, ""))
                        fragments.append(0)
                    else:
                        assert d.index == len(calls) - 1 and d.function.name is None
                        calls[-1] = (calls[-1][0], calls[-1][1] + d.function.arguments)
                        fragments[-1] += 1
                finish = ch.finish_reason or finish
        assert finish == whole.finish_reason, (seed, finish, whole.finish_reason)
        want = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []]
        n = len(want)
        assert [(name, json.loads(args)) for name, args in calls[:n]] == want, seed
        for name, args in calls[:n]:
            jsonschema.validate(json.loads(args), schemas[name])
        steps, _ = stream(whole.message.content or "", [], finish)  # the rest: an unfinished block, at "length"
        rest_content, rest_calls = assemble(steps)
        assert content == rest_content
        assert [(name, args.rstrip()) for name, args in calls[n:]] == [(m, a.rstrip()) for m, a in rest_calls]
        finished += finish == "tool_calls"
        split += any(f >= 2 for f in fragments)
    assert finished >= 1, "at least one request ended with its tool calls"
    assert split >= 1, "arguments came in pieces, not at the end"
