"""Front-end grader: the output's HTML/CSS parsed with lxml (and tinycss2) against the item's requirements.

check = {
  "tags": ["form", "button"],                       # each tag name present
  "selectors": ["nav ul li a", "input[type=email]"], # each CSS selector matches an element
  "attributes": [{"selector": "img", "attr": "alt", "value": "Logo"?}],  # a matched element has it
                                                    # (with "value": equal to it, case-insensitive)
  "classes": ["card"],                              # each class on some element
  "css": [{"property": "display", "value": "flex"?, "selector": ".row"?}],  # declared in <style> or style="";
                                                    # value: from a token start ("0" matches "0px", not "10px")
  "texts": ["Sign in"],                             # visible text (and input button values) contains it
}
Every entry is one requirement; score = fraction satisfied, passed = all satisfied. The HTML is the output's
``html``/``htm`` fences (``css`` fences become a <style>), else the whole output. With
``VERISPEC_AUDIT_RENDER=1`` and a headless Chromium on PATH the page is also rendered (scripts run) and the
DOM requirements re-checked on the rendered DOM (``details["rendered"]``), with ``blank``: the rendered body shows
no text and no visible element (image, form control, canvas, svg, video, iframe); it never changes the score.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from verispec.audit.graders.base import Grade
from verispec.audit.graders.text import fenced_blocks

KEYS = ("tags", "selectors", "attributes", "classes", "css", "texts")
_PSEUDO = re.compile(r"::?[A-Za-z-]+(?:\([^)]*\))?")
_VISIBLE = ("img", "input", "button", "select", "textarea", "canvas", "svg", "video", "iframe", "object", "embed")
_CHROMIUM = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")


def validate(check: dict[str, Any]) -> None:
    """Raise ValueError unless ``check`` is a well-formed front_end check with at least one requirement."""
    from cssselect import GenericTranslator, SelectorError

    unknown = set(check) - set(KEYS)
    if unknown:
        raise ValueError(f"front_end check: unknown key(s) {sorted(unknown)}; expected {KEYS}")
    if not any(check.get(k) for k in KEYS):
        raise ValueError("front_end check: no requirement")
    for k in ("tags", "selectors", "classes", "texts"):
        if not all(isinstance(v, str) and v for v in check.get(k, [])):
            raise ValueError(f"front_end check: {k!r} must be a list of non-empty strings")
    sels = list(check.get("selectors", []))
    for a in check.get("attributes", []):
        if not (isinstance(a, dict) and isinstance(a.get("selector"), str) and isinstance(a.get("attr"), str)):
            raise ValueError(f"front_end check: attribute requirement needs 'selector' and 'attr': {a!r}")
        sels.append(a["selector"])
    for c in check.get("css", []):
        if not (isinstance(c, dict) and isinstance(c.get("property"), str)):
            raise ValueError(f"front_end check: css requirement needs 'property': {c!r}")
        if "selector" in c:
            sels.append(_PSEUDO.sub("", c["selector"]) or "*")
    for s in sels:
        try:
            GenericTranslator().css_to_xpath(s)
        except SelectorError as e:
            raise ValueError(f"front_end check: bad selector {s!r} ({e})") from None


def extract_html(output: str) -> str:
    """The page in the output: its html fences (css fences as a <style>), else the whole text."""
    blocks = fenced_blocks(output)
    html = [b for lang, b in blocks if lang in ("html", "htm", "xml", "xhtml", "")]
    css = [b for lang, b in blocks if lang == "css"]
    if not html and not css:
        return output
    return "\n".join(html) + "".join(f"\n<style>\n{c}\n</style>" for c in css)


def _parse(html: str):
    import lxml.html
    from lxml import etree

    if "<" not in html:
        return None
    try:
        return lxml.html.document_fromstring(html)
    except (etree.ParserError, ValueError):
        return None


def _select(doc, selector: str) -> list:
    try:
        return doc.cssselect(selector)
    except Exception:  # cssselect's SelectorError / ExpressionError (e.g. an unsupported pseudo-class)
        return []


def _declarations(doc) -> list[tuple[list | None, str, str, str]]:
    """Every CSS declaration: (elements its rule applies to or None if unknown, selector text, property, value)."""
    import tinycss2

    out: list[tuple[list | None, str, str, str]] = []
    for el in doc.iter("style"):
        _rules(tinycss2.parse_stylesheet(el.text_content() or "", skip_comments=True, skip_whitespace=True), doc, out)
    for el in doc.xpath("//*[@style]"):
        for d in tinycss2.parse_blocks_contents(el.get("style"), skip_comments=True, skip_whitespace=True):
            if d.type == "declaration":
                out.append(([el], "", d.lower_name, tinycss2.serialize(d.value).strip()))
    return out


def _rules(rules, doc, out: list) -> None:
    import tinycss2

    for r in rules:
        if r.type == "at-rule" and r.content is not None:
            _rules(tinycss2.parse_rule_list(r.content, skip_comments=True, skip_whitespace=True), doc, out)
        elif r.type == "qualified-rule":
            sel = tinycss2.serialize(r.prelude).strip()
            els = [e for s in sel.split(",") for e in _select(doc, _PSEUDO.sub("", s).strip() or "*")]
            for d in tinycss2.parse_blocks_contents(r.content, skip_comments=True, skip_whitespace=True):
                if d.type == "declaration":
                    out.append((els, sel, d.lower_name, tinycss2.serialize(d.value).strip()))


def _norm(s: str) -> str:
    return " ".join(s.lower().replace("!important", "").split())


def _value_in(want: str, value: str) -> bool:
    """``want`` occurs in the declared value from a token start: "0" in "0px" and "flex" in "flex", not "0" in
    "10px" or "flex" in "inline-flex"."""
    return re.search(r"(?<![\w.#-])" + re.escape(_norm(want)), _norm(value)) is not None


def _css_ok(req: dict[str, Any], doc, decls: list) -> bool:
    want = req.get("selector")
    tree = doc.getroottree()
    if want:  # elements are compared by their path (lxml's element proxies are not stable identities)
        targets = {tree.getpath(e) for e in _select(doc, _PSEUDO.sub("", want).strip() or "*")}
        pseudos = _PSEUDO.findall(want)
    for els, sel, prop, value in decls:
        if prop != req["property"].lower():
            continue
        if "value" in req and not _value_in(str(req["value"]), value):
            continue
        if want:
            if not els or not targets & {tree.getpath(e) for e in els}:
                continue
            if any(p not in sel for p in pseudos):
                continue
        return True
    return False


def _dom_results(check: dict[str, Any], doc) -> dict[str, bool]:
    res: dict[str, bool] = {}
    for t in check.get("tags", []):
        res[f"tag {t}"] = any(True for _ in doc.iter(t.lower()))
    for s in check.get("selectors", []):
        res[f"selector {s}"] = bool(_select(doc, s))
    for a in check.get("attributes", []):
        vals = [e.get(a["attr"]) for e in _select(doc, a["selector"]) if e.get(a["attr"]) is not None]
        ok = bool(vals) if "value" not in a else any(_norm(v) == _norm(str(a["value"])) for v in vals)
        res[f"attribute {a['selector']}[{a['attr']}]"] = ok
    classes = {c for e in doc.xpath("//*[@class]") for c in e.get("class").split()}
    for c in check.get("classes", []):
        res[f"class {c}"] = c in classes
    labels = [e.get("value", "") for e in doc.xpath("//input[@type='submit' or @type='button' or @type='reset']")]
    text = _norm(" ".join([doc.text_content(), *labels]))  # an <input type=submit value=...> shows its value
    for t in check.get("texts", []):
        res[f"text {t}"] = _norm(t) in text
    return res


def blank(doc: Any) -> bool:
    """A rendered page that shows nothing: no text outside scripts and styles, no visible element in its body."""
    body = doc.find(".//body")
    root = body if body is not None else doc
    text = "".join(t for t in root.xpath(".//text()[not(ancestor::script) and not(ancestor::style)]"))
    return not text.strip() and not any(root.iter(*_VISIBLE))


def render_dom(html: str, timeout_s: float = 20.0) -> str | None:
    """The DOM after a headless Chromium loads ``html`` (scripts run), or None when none is installed or it fails."""
    exe = next((p for p in map(shutil.which, _CHROMIUM) if p), None)
    if exe is None:
        return None
    with tempfile.TemporaryDirectory(prefix="verispec-render-") as tmp:
        page = Path(tmp) / "page.html"
        page.write_text(html, encoding="utf-8")
        cmd = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--dump-dom", page.as_uri()]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
        except (OSError, subprocess.TimeoutExpired):
            return None
    return r.stdout if r.returncode == 0 and r.stdout.strip() else None


def grade(check: dict[str, Any], output: str) -> Grade:
    validate(check)
    html = extract_html(output)
    doc = _parse(html)
    if doc is None:
        n = sum(len(check.get(k, [])) for k in KEYS)
        return Grade(0.0, False, {"error": "no HTML found", "satisfied": 0, "required": n})
    res = _dom_results(check, doc)
    decls = _declarations(doc)
    for c in check.get("css", []):
        key = f"css {c.get('selector', '*')} {{{c['property']}{': ' + str(c['value']) if 'value' in c else ''}}}"
        res[key] = _css_ok(c, doc, decls)
    details: dict[str, Any] = {"satisfied": sum(res.values()), "required": len(res),
                               "missing": [k for k, ok in res.items() if not ok]}
    if os.environ.get("VERISPEC_AUDIT_RENDER") == "1":
        dom = render_dom(html)
        rendered = _parse(dom) if dom else None
        if rendered is not None:
            r2 = _dom_results(check, rendered)
            details["rendered"] = {"satisfied": sum(r2.values()), "required": len(r2), "blank": blank(rendered)}
    score = details["satisfied"] / len(res)
    return Grade(score, score == 1.0, details)
