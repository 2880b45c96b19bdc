"""The documentation stays true: links resolve, the README stays short, docs/design.md names real functions, and the
README's Python example imports names that exist.

Each check is a pure function over text, so the planted-error tests below show that it can fail.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
README_LIMIT = 12288  # bytes
DOCS = sorted((ROOT / "docs").rglob("*.md"))

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
DOTTED = re.compile(r"`(verispec(?:\.[A-Za-z_]\w*)+)`")


def strip_code(text: str) -> str:
    """Markdown without fenced code blocks (a link inside code is not a link)."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in strip_code(path.read_text()).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path, text: str | None = None) -> list[str]:
    """Relative links of a Markdown file whose target file, or heading anchor, does not exist."""
    text = path.read_text() if text is None else text
    bad = []
    for target in LINK.findall(strip_code(text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading")
    return bad


def resolve_dotted(name: str) -> bool:
    """Whether `verispec.a.b.Name.attr` is a real attribute: the longest importable module prefix, then getattr."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text, re.M | re.S)


def missing_imports(code: str) -> list[str]:
    """`from verispec... import X` names in a code block that the module does not have."""
    bad = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "verispec":
            for alias in node.names:
                if not resolve_dotted(f"{node.module}.{alias.name}"):
                    bad.append(f"{node.module}.{alias.name}")
    return bad


# ---- the checks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path: Path) -> None:
    assert broken_links(path) == []


def test_readme_is_short() -> None:
    assert README.stat().st_size <= README_LIMIT, f"README.md is {README.stat().st_size} bytes"


def test_readme_has_no_dates() -> None:
    assert not re.search(r"20\d\d-[01]\d-[0-3]\d", README.read_text())


def test_design_names_real_functions() -> None:
    names = sorted(set(DOTTED.findall((ROOT / "docs" / "design.md").read_text())))
    assert len(names) >= 30, "design.md names the functions of a step as `verispec.module.function`"
    assert [n for n in names if not resolve_dotted(n)] == []


def test_readme_example_imports_exist() -> None:
    blocks = python_blocks(README.read_text())
    assert blocks, "the README has a Python example"
    assert all(missing_imports(b) == [] for b in blocks)


# ---- the checks can fail ---------------------------------------------------------------------------------------
def test_a_planted_broken_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page.write_text("[ok](other.md) [ok](other.md#a-section) [ok](#other-page) [web](https://example.com)\n"
                    "```\n[in code](nowhere.md)\n```\n[missing](nowhere.md) [bad anchor](other.md#no-section)\n")
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page.write_text(page.read_text() + "# Page\n")
    assert broken_links(page) == ["#other-page: no such heading", "nowhere.md: no such file",
                                  "other.md#no-section: no such heading"]


def test_slugs_follow_github() -> None:
    assert slug("1. The verification rule") == "1-the-verification-rule"
    assert slug("Weight paths: `--dtype auto`") == "weight-paths---dtype-auto"
    assert slug("How the scheduler decides") == "how-the-scheduler-decides"


def test_a_planted_wrong_name_is_caught() -> None:
    assert resolve_dotted("verispec.engine.core.Engine.step")
    assert not resolve_dotted("verispec.engine.core.Engine.no_such_method")
    assert not resolve_dotted("verispec.no_such_module.function")


def test_a_planted_wrong_import_is_caught() -> None:
    assert missing_imports("from verispec import LLM, SamplingParams\n") == []
    assert missing_imports("from verispec import LLM, NoSuchThing\n") == ["verispec.NoSuchThing"]
