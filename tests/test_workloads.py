import json

import pytest

from verispec.bench.workloads import WORKLOADS, WorkloadPrompt, load_workload, load_workloads


@pytest.mark.parametrize("name", WORKLOADS)
def test_shipped_workload_loads(name):
    prompts = load_workload(name)
    assert len(prompts) >= 20
    ids = [p.id for p in prompts]
    assert len(set(ids)) == len(ids)
    for p in prompts:
        assert isinstance(p, WorkloadPrompt)
        assert p.workload == name
        assert p.id.startswith(f"{name}-")
        users = [m for m in p.messages if m["role"] == "user"]
        assert users and all(m["content"].strip() for m in users)
        assert 16 <= p.max_tokens <= 1024


def test_limit_and_load_workloads():
    assert len(load_workload("chat", limit=3)) == 3
    got = load_workloads(["code", "chat"])
    assert set(got) == {"code", "chat"} and all(got.values())


def test_user_jsonl_turns_and_prompt(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text(
        json.dumps({"turns": ["Hello there", "second turn"]}) + "\n\n"
        + json.dumps({"prompt": "Write a haiku", "max_tokens": 64}) + "\n"
    )
    prompts = load_workload(f)
    assert len(prompts) == 2
    assert prompts[0].messages == ({"role": "user", "content": "Hello there"},)
    assert prompts[0].max_tokens == 128 and prompts[0].workload == "mine"
    assert prompts[1].messages[0]["content"] == "Write a haiku" and prompts[1].max_tokens == 64
    assert prompts[0].id != prompts[1].id
    assert load_workload(str(f), limit=1)[0].id == prompts[0].id


def test_malformed_line_names_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "ok"}) + "\n" + "{not json\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl.*line 2"):
        load_workload(f)
    f.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 2"):
        load_workload(f)


def test_unknown_name_lists_shipped():
    with pytest.raises(ValueError) as ei:
        load_workload("no_such_workload")
    for name in WORKLOADS:
        assert name in str(ei.value)
