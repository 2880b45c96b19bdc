"""The package's layering, checked from its source text (ast) and, for the scheduling layer, by importing it.

a. the import graph of `verispec` (every import of a verispec module: module level, inside functions, under
   `if TYPE_CHECKING:`) has no cycle, and every import points down LAYERS (or within one layer);
b. scheduling (`verispec.engine.scheduler`, `.costs`, `.acceptance`) pulls in no torch, model, execution or
   drafter code, neither when imported in a fresh interpreter nor through its static imports;
c. no function in the engine and state layers is longer than MAX_FUNCTION_LINES lines;
d. docs/structure.md lists exactly the modules that exist.
"""

from __future__ import annotations

import ast
import functools
import json
import re
import subprocess
import sys
from collections import deque
from fnmatch import fnmatch
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
PACKAGE = "verispec"
STRUCTURE_DOC = ROOT / "docs" / "structure.md"

SCHEDULING = ("verispec.engine.scheduler", "verispec.engine.costs", "verispec.engine.acceptance")
NOT_IN_SCHEDULING = ("torch*", "verispec.models*", "verispec.execution*", "verispec.drafters*")
SHORT_FUNCTION_DIRS = ("engine", "state")
MAX_FUNCTION_LINES = 45

# The layers, bottom first; a module may import its own layer's modules and those of the layers below it. A name is a
# top-level module or package of verispec ("verispec" is the package's own __init__, the public facade).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("config",),
    ("sampling", "kernels"),  # sampling arithmetic and parameters; the C kernel: build, choice by measurement, formats
    ("state",),  # KV caches, block pool, the request's state
    ("models",),  # checkpoints and the one decoder implementation
    ("check",),  # the state oracle and the identity check the layers above assert with
    ("execution",),  # the batched forward, verification arithmetic, hidden-state recording, weight paths
    ("drafters",),
    ("engine",),  # scheduling (costs, scheduler: no tensors), the step loop, profiling the step costs
    ("api", "outputs", "tools", "tool_stream", "verispec"),  # the Python API and its outputs; tool calling (prompt, grammar,
    # parser), shared with the server
    ("server", "bench", "train", "doctor"),
    ("audit", "demo"),
    ("cli", "__main__"),
)

Graph = dict[str, dict[str, int]]  # module -> {imported module: line of the first such import}


# ---- the import graph --------------------------------------------------------------------------------------------


def module_name(path: Path, src: Path = SRC) -> str:
    """`src/verispec/a/b.py` -> `verispec.a.b`; a package's `__init__.py` -> the package's name."""
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def discover(src: Path = SRC, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package under `src`, by dotted name."""
    return {module_name(p, src): p for p in sorted((src / package).rglob("*.py")) if "__pycache__" not in p.parts}


def _existing(name: str, modules: set[str]) -> str | None:
    """`name` if it is a module, else its longest prefix that is one (`verispec.x.attr` -> `verispec.x`)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _import_base(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` statement names (relative imports resolved against `importer`)."""
    if not node.level:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    for _ in range(node.level - 1):
        package = package.rpartition(".")[0]
    return f"{package}.{node.module}" if node.module else package


def imports_of(source: str, importer: str, is_package: bool, modules: set[str],
               package: str = PACKAGE) -> dict[str, int]:
    """The package's modules that `source` imports anywhere (ast.walk reaches function bodies and TYPE_CHECKING
    blocks alike), each with the line of its first import. `from a.b import c` means module `a.b.c` when that is a
    module, else `a.b`. The implicit import of a module's parent packages is not an edge; neither is a self-import."""
    found: dict[str, int] = {}

    def add(target: str | None, line: int) -> None:
        if target and target != importer and (target == package or target.startswith(package + ".")):
            found.setdefault(target, line)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(_existing(alias.name, modules), node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _import_base(node, importer, is_package)
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                add(sub if sub in modules else _existing(base, modules), node.lineno)
    return dict(sorted(found.items(), key=lambda kv: kv[1]))


@functools.cache
def import_graph(src: Path = SRC, package: str = PACKAGE) -> Graph:
    """The package's import graph (the callers only read it)."""
    modules = discover(src, package)
    names = set(modules)
    return {name: imports_of(path.read_text(), name, path.name == "__init__.py", names, package)
            for name, path in modules.items()}


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted, in sorted order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def shortest_cycle_through(start: str, graph: Graph, within: set[str]) -> list[str]:
    """The shortest cycle start -> ... -> start inside `within` (BFS), as a list of module names."""
    parent: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, {})):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return path[::-1] + [start]
            if w in within and w not in parent:
                parent[w] = v
                queue.append(w)
    raise AssertionError(f"{start} is on no cycle")


def cycles(graph: Graph) -> list[list[str]]:
    """One shortest cycle per strongly connected component of more than one module."""
    return [shortest_cycle_through(comp[0], graph, set(comp)) for comp in strongly_connected(graph) if len(comp) > 1]


def describe(cycle: list[str], graph: Graph) -> str:
    return "; ".join(f"{a} imports {b} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:]))


def reachable(graph: Graph, roots: tuple[str, ...]) -> dict[str, list[str]]:
    """Every module reachable from `roots`, with one import chain that reaches it."""
    chain = {r: [r] for r in roots}
    queue = deque(roots)
    while queue:
        v = queue.popleft()
        for w in graph.get(v, {}):
            if w not in chain:
                chain[w] = chain[v] + [w]
                queue.append(w)
    return chain


def matches(name: str, patterns: tuple[str, ...] = NOT_IN_SCHEDULING) -> bool:
    return any(fnmatch(name, p) for p in patterns)


# ---- the checker's own machinery, on planted input ---------------------------------------------------------------


def test_import_collector_sees_every_kind_of_import() -> None:
    modules = {"verispec", "verispec.a", "verispec.a.b", "verispec.a.c", "verispec.d", "verispec.e", "verispec.f",
               "verispec.g", "verispec.h"}
    source = """
from __future__ import annotations
import os
from typing import TYPE_CHECKING
import verispec.d
from verispec.a import b, helper
from . import c
from .. import e
if TYPE_CHECKING:
    from verispec.f import Thing
def late():
    import verispec.g.attr
    from verispec import h
    from verispec.a.c import x
"""
    found = imports_of(source, "verispec.a.mod", False, modules)
    assert set(found) == {"verispec.d", "verispec.a.b", "verispec.a", "verispec.a.c", "verispec.e", "verispec.f",
                          "verispec.g", "verispec.h"}
    assert found["verispec.f"] == 10 and found["verispec.h"] == 13 and found["verispec.a.c"] == 7
    # in a package's __init__, `from . import x` is relative to the package itself; a self-import is no edge
    assert set(imports_of("from . import b\nfrom verispec.a import thing\n", "verispec.a", True, modules)) == {
        "verispec.a.b"}


def test_cycle_finder_on_planted_graphs() -> None:
    g = {"m.a": {"m.b": 1}, "m.b": {"m.c": 2}, "m.c": {"m.a": 3, "m.d": 4}, "m.d": {}, "m.x": {"m.y": 1},
         "m.y": {"m.x": 1}}
    assert cycles(g) == [["m.a", "m.b", "m.c", "m.a"], ["m.x", "m.y", "m.x"]]
    assert cycles({"m.a": {"m.b": 1}, "m.b": {"m.c": 1}, "m.c": {}}) == []
    assert reachable(g, ("m.c",))["m.b"] == ["m.c", "m.a", "m.b"]


def test_the_real_graph_is_not_empty() -> None:
    graph = import_graph()
    assert set(SCHEDULING) <= set(graph), "the scheduling modules moved: update SCHEDULING here"
    assert sum(map(len, graph.values())) > len(graph), "too few imports found: the collector is broken"


# ---- a. no import cycle -------------------------------------------------------------------------------------------


def test_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    found = cycles(graph)
    assert not found, "import cycles in verispec (counting imports inside functions and under TYPE_CHECKING):\n" + \
        "\n".join(f"{c}\n    {describe(c, graph)}" for c in found)


def layer_of(module: str, layers: tuple[tuple[str, ...], ...] = LAYERS) -> int:
    """The index in `layers` of the layer `module` (a dotted verispec name) belongs to."""
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else parts[0]
    for i, names in enumerate(layers):
        if top in names:
            return i
    raise AssertionError(f"{module}: its package {top!r} is in no layer: add it to LAYERS")


def upward_imports(graph: Graph, layers: tuple[tuple[str, ...], ...] = LAYERS) -> list[str]:
    """Every import in `graph` from a lower layer to a higher one, as 'a (layer) imports b (layer) at line n'."""
    return [f"{a} ({layers[layer_of(a, layers)][0]}) imports {b} ({layers[layer_of(b, layers)][0]}) at line {line}"
            for a, targets in sorted(graph.items()) for b, line in targets.items()
            if layer_of(b, layers) > layer_of(a, layers)]


def test_layer_checker_on_planted_graph() -> None:
    layers = (("low",), ("mid", "side"), ("high",))
    g = {"verispec.low.a": {}, "verispec.mid.b": {"verispec.low.a": 3, "verispec.side": 4},
         "verispec.side": {"verispec.high.c": 7}, "verispec.high.c": {"verispec.mid.b": 1}}
    assert upward_imports(g, layers) == ["verispec.side (mid) imports verispec.high.c (high) at line 7"]


def test_imports_only_point_down_the_layers() -> None:
    graph = import_graph()
    assert {layer_of(m) for m in graph}, "no module placed"
    bad = upward_imports(graph)
    assert not bad, "imports that run up a layer (LAYERS, bottom first, is in this file):\n" + "\n".join(bad)


# ---- b. scheduling imports no model code --------------------------------------------------------------------------


def test_scheduling_imports_no_model_code_at_runtime() -> None:
    code = (f"import json, sys\nimport {', '.join(SCHEDULING)}\n"
            "print(json.dumps(sorted(sys.modules)))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    bad = [m for m in loaded if matches(m)]
    assert not bad, f"importing {', '.join(SCHEDULING)} loads {bad}"


def test_scheduling_imports_no_model_code_statically() -> None:
    chains = reachable(import_graph(), SCHEDULING)
    bad = {m: chain for m, chain in sorted(chains.items()) if matches(m)}
    assert not bad, f"{', '.join(SCHEDULING)} import (transitively):\n" + \
        "\n".join(" -> ".join(chain) for chain in bad.values())


# ---- c. short functions in the engine and state layers ------------------------------------------------------------


def long_functions(path: Path, limit: int = MAX_FUNCTION_LINES) -> list[tuple[int, str, int]]:
    """(line, qualified name, length) of every function or method in `path`, nested ones too, longer than `limit`."""
    out: list[tuple[int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = child.end_lineno - child.lineno + 1
                if n > limit:
                    out.append((child.lineno, prefix + child.name, n))
                visit(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return out


def test_long_functions_finder_on_planted_source(tmp_path: Path) -> None:
    body = "\n".join(f"        x{i} = {i}" for i in range(50))
    (tmp_path / "m.py").write_text(f"class C:\n    def short(self):\n        pass\n\n    def long(self):\n{body}\n"
                                   f"        def inner():\n{body.replace('        ', '            ')}\n")
    assert long_functions(tmp_path / "m.py") == [(5, "C.long", 102), (56, "C.long.<locals>.inner", 51)]


def test_engine_and_state_functions_are_short() -> None:
    offenders = [f"{path.relative_to(ROOT).as_posix()}:{line} {name} ({n} lines)"
                 for d in SHORT_FUNCTION_DIRS for path in sorted((SRC / PACKAGE / d).rglob("*.py"))
                 for line, name, n in long_functions(path)]
    assert not offenders, f"functions longer than {MAX_FUNCTION_LINES} lines:\n" + "\n".join(offenders)


# ---- d. docs/structure.md lists exactly the modules -------------------------------------------------------------


def test_structure_doc_lists_exactly_the_modules() -> None:
    table = [line for line in STRUCTURE_DOC.read_text().splitlines() if line.lstrip().startswith("|")]
    listed = {m for line in table for m in re.findall(rf"\bsrc/{PACKAGE}/[\w/]+\.py\b", line)}
    actual = {p.relative_to(ROOT).as_posix() for p in discover().values()}
    missing, stale = sorted(actual - listed), sorted(listed - actual)
    assert not missing and not stale, (f"{STRUCTURE_DOC.relative_to(ROOT)}: modules not listed: {missing}; "
                                       f"listed modules that do not exist: {stale}")


# ---- e. the source carries no dated measurements and points nowhere outside the repository ---------------------

DATE = re.compile(r"\b20\d{2}-[01]\d-[0-3]\d\b")
OUTSIDE = re.compile(r"METHODS\.md|MEASURE\.md|STYLE\.md|\.\./shared")


def source_files() -> list[Path]:
    """The package's Python and C sources (not build metadata such as an editable install's egg-info)."""
    return sorted(p for p in (SRC / PACKAGE).rglob("*") if p.suffix in (".py", ".c") and "__pycache__" not in p.parts)


def offending_lines(pattern: re.Pattern[str], paths: list[Path], root: Path = ROOT) -> list[str]:
    return [f"{p.relative_to(root).as_posix()}:{i}: {line.strip()[:100]}" for p in paths
            for i, line in enumerate(p.read_text().splitlines(), start=1) if pattern.search(line)]


def test_line_finders_on_planted_source(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('"""measured 2026-12-03 on one machine"""\nx = 1  # see METHODS.md section 5\n'
                                   'y = 2  # version 2026.12, not a date\n')
    assert [s.split(":")[1] for s in offending_lines(DATE, [tmp_path / "a.py"], tmp_path)] == ["1"]
    assert [s.split(":")[1] for s in offending_lines(OUTSIDE, [tmp_path / "a.py"], tmp_path)] == ["2"]


def test_source_has_no_dates_and_no_references_outside_the_repository() -> None:
    files = source_files()
    assert any(p.suffix == ".c" for p in files) and len(files) > 100, "the source finder is broken"
    dated, outside = offending_lines(DATE, files), offending_lines(OUTSIDE, files)
    assert not dated, "dated lines in src/ (measurements belong in docs/results/):\n" + "\n".join(dated)
    assert not outside, "src/ cites files outside the repository (cite docs/ instead):\n" + "\n".join(outside)


DOC_CITATION = re.compile(r"\bdocs/[\w/.-]+?\.md\b")


def test_every_docs_page_the_source_cites_exists() -> None:
    cited = {(m.group(0), line) for line in offending_lines(DOC_CITATION, source_files())
             for m in DOC_CITATION.finditer(line.split(": ", 1)[1])}
    assert len(cited) > 5, "the citation finder is broken"
    missing = sorted(f"{line.split(': ', 1)[0]} cites {page}" for page, line in cited if not (ROOT / page).is_file())
    assert not missing, "src/ cites docs pages that do not exist:\n" + "\n".join(missing)
