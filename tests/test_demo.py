"""`verispec demo`, the README's main-job command, end to end on the default model (short outputs)."""

from __future__ import annotations

import pytest

from verispec.cli import main

pytestmark = pytest.mark.slow


def test_demo_prints_the_table_and_writes_the_report(tmp_path, capsys):
    assert main(["demo", "--max-tokens", "8", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for wl in ("json_records", "templates", "markdown", "code", "chat"):
        for method in ("none", "ngram", "suffix"):
            assert f"| {wl} | {method} |" in out
    assert "- baseline: speculation off" in out
    page = (tmp_path / "report.html").read_text()
    assert "<table>" in page and "data:image/png;base64," in page
