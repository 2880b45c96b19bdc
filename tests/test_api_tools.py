"""Tool calling in the Python API, `LLM.chat(..., tools=...)` (verispec/tools.py, shared with the server): the
prompt carries the tools, `required` / a named function constrain the output to calls whose arguments validate
with `jsonschema` against the function's parameters (the calls read back from the raw text by this file's own
reader, not the engine's parser), greedy speculative output equals plain, bad arguments raise ValueError naming
them, and without tools the outputs are those of the plain chat prompt with `tool_calls` None."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from verispec import LLM, SamplingParams

WEATHER = {"name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
ADD = {"name": "add",
       "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9},
                                                       "b": {"type": "integer", "minimum": 0, "maximum": 9}},
                      "required": ["a", "b"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": ADD}]
PARAMS = {f["function"]["name"]: f["function"]["parameters"] for f in TOOLS}
MESSAGES = [{"role": "user", "content": "Weather in Oslo?"}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=48)
BLOCK = re.compile(r"<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


@pytest.fixture(scope="module")
def plain(tiny_dir):
    return LLM(str(tiny_dir), dtype="float32", device="cpu", progress=False)


def _calls_in(text: str) -> list[dict]:
    """The calls in a raw output, read independently of verispec's parser: each `<tool_call>` block's JSON."""
    return [json.loads(m) for m in BLOCK.findall(text)]


def _check_calls(out, allowed: set[str]) -> None:
    assert out.tool_calls, out.text
    ref = _calls_in(out.text)
    assert [(c["name"], c["arguments"]) for c in ref] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in out.tool_calls]
    for call in out.tool_calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        name, args = call["function"]["name"], json.loads(call["function"]["arguments"])
        assert name in allowed
        jsonschema.validate(args, PARAMS[name])


@pytest.mark.parametrize("parallel", [False, True])
def test_required_returns_schema_valid_calls(plain, parallel):
    out = plain.chat(MESSAGES, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=parallel)[0]
    _check_calls(out, {"get_weather", "add"})
    if not parallel:
        assert len(out.tool_calls) == 1 and out.finish_reason == "stop"
    # the prompt carries the tools: every function's name and parameter schema
    for t in TOOLS:
        assert t["function"]["name"] in out.prompt
        assert json.dumps(t["function"]["parameters"], separators=(",", ":")) in out.prompt.replace(", ", ",").replace(
            ": ", ":")


def test_named_function_only_calls_it(plain):
    choice = {"type": "function", "function": {"name": "add"}}
    outs = plain.chat([MESSAGES, [{"role": "user", "content": "Two plus three?"}]],
                      [GREEDY, SamplingParams(temperature=0.8, seed=7, max_tokens=48)], use_tqdm=False,
                      tools=TOOLS, tool_choice=choice, parallel_tool_calls=False)
    assert len(outs) == 2
    for out in outs:
        _check_calls(out, {"add"})


def test_greedy_speculation_equals_plain_with_tools(plain):
    fast = plain.with_speculation({"method": "ngram", "num_speculative_tokens": 4}, check_state=True)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}, "auto"):
        a = plain.chat(MESSAGES, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice=choice)[0]
        b = fast.chat(MESSAGES, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice=choice)[0]
        assert b.token_ids == a.token_ids and b.text == a.text
        assert [c["function"] for c in b.tool_calls] == [c["function"] for c in a.tool_calls]  # ids are random


def test_auto_keeps_the_raw_text_and_parses_it(plain):
    out = plain.chat(MESSAGES, GREEDY, use_tqdm=False, tools=TOOLS)[0]
    assert isinstance(out.tool_calls, list)
    free = plain.generate({"prompt_token_ids": out.prompt_token_ids}, GREEDY, use_tqdm=False)[0]
    assert out.text == free.text  # no grammar under "auto": the model's own output, unparsed
    assert [c["function"]["name"] for c in out.tool_calls] == [c.get("name") for c in _calls_in(out.text)
                                                                if isinstance(c, dict)]


def test_without_tools_outputs_are_unchanged(plain):
    out = plain.chat(MESSAGES, GREEDY, use_tqdm=False)[0]
    assert out.tool_calls is None
    text = plain.tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ref = plain.generate({"prompt_token_ids": plain.tokenizer(text, add_special_tokens=False)["input_ids"]}, GREEDY,
                         use_tqdm=False)[0]
    assert out.prompt == text and out.token_ids == ref.token_ids and out.text == ref.text
    none = plain.chat(MESSAGES, GREEDY, use_tqdm=False, tools=TOOLS, tool_choice="none")[0]
    assert none.prompt == text and none.token_ids == ref.token_ids and none.tool_calls == []


@pytest.mark.parametrize("kwargs, argument", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
])
def test_bad_arguments_raise_value_error_naming_them(plain, kwargs, argument):
    with pytest.raises(ValueError, match=re.escape(f"'{argument}'")):
        plain.chat(MESSAGES, GREEDY, use_tqdm=False, **kwargs)


def test_required_refuses_other_structured_outputs(plain):
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": ["a", "b"]})
    with pytest.raises(ValueError, match="tool_choice"):
        plain.chat(MESSAGES, params, use_tqdm=False, tools=TOOLS, tool_choice="required")
