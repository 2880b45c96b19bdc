"""Coding grader: the output's Python run with the item's unit tests in a subprocess; pass@1 = all tests pass.

check = {"function": "is_even", "tests": ["assert is_even(2)", ...], "timeout_s": 5?, "reference_solution": "..."?}
The code is the fenced python block defining ``function`` (else all python / unlabelled fences joined, else the
whole output). It runs under ``sys.executable -I`` in a fresh temporary directory with a wall-clock timeout
(the process group is killed), stdin closed, and where ``resource`` exists an address-space (1 GiB), CPU and
file-size limit set by the harness before the code runs. The harness replaces ``socket.socket`` with a class
whose constructor raises and ``create_connection``, ``getaddrinfo``, ``socketpair``, ``create_server`` with
functions that raise: a GUARD against accidental network use, NOT a sandbox (code can still reach ``_socket``,
the file system and other processes); run untrusted outputs in a container.
The code runs as module ``solution`` (an ``if __name__ == "__main__"`` block does not run), its prints discarded.
``reference_solution`` is for the item's own tests and is never graded as output.
score = 1.0 when every test passes, else 0.0; ``details`` has the count passed and the first error.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from verispec.audit.graders.base import Grade
from verispec.audit.graders.text import fenced_blocks

DEFAULT_TIMEOUT_S = 5.0
MEMORY_LIMIT_BYTES = 1 << 30
_MARK = "@@verispec-audit-result@@"

_HARNESS = r'''
import json, os, socket, sys
spec = json.load(open("spec.json", encoding="utf-8"))
try:
    import resource
    for _lim, _val in ((resource.RLIMIT_AS, spec["memory"]), (resource.RLIMIT_CPU, spec["cpu_s"]),
                       (resource.RLIMIT_FSIZE, 16 << 20)):
        try:
            resource.setrlimit(_lim, (_val, _val))
        except (ValueError, OSError):
            pass
except ImportError:
    pass
def _no_network(*a, **k):
    raise OSError("network access is disabled in verispec audit")
class _NoSocket(socket.socket):  # a class, so that modules subclassing socket.socket (ssl) still import
    def __init__(self, *a, **k):
        _no_network()
socket.socket = _NoSocket
for _n in ("create_connection", "getaddrinfo", "socketpair", "create_server"):
    setattr(socket, _n, _no_network)
del _n
ns = {"__name__": "solution"}  # not "__main__": a main block (input(), argparse) does not run
sys.stdout = sys.stderr = open(os.devnull, "w")  # the code's prints (a print loop) go nowhere
res = {"loaded": False, "defined": False, "passed": 0, "total": len(spec["tests"]), "error": None}
def _report():
    sys.__stdout__.write("\n" + spec["mark"] + json.dumps(res) + "\n")
    sys.__stdout__.flush()
try:
    exec(compile(spec["code"], "solution.py", "exec"), ns)
    res["loaded"] = True
except BaseException as e:
    res["error"] = "loading the code: " + type(e).__name__ + ": " + str(e)[:300]
if res["loaded"]:
    res["defined"] = callable(ns.get(spec["function"]))
    if not res["defined"]:
        res["error"] = "function %r is not defined" % spec["function"]
    for i, t in enumerate(spec["tests"] if res["defined"] else []):
        try:
            exec(compile(t, "test_%d" % i, "exec"), ns)
            res["passed"] += 1
        except BaseException as e:
            if res["error"] is None:
                res["error"] = "test %d: %s: %s" % (i, type(e).__name__, str(e)[:300])
_report()
'''


def validate(check: dict[str, Any]) -> None:
    """Raise ValueError unless ``check`` is a well-formed coding check."""
    if not (isinstance(check.get("function"), str) and check["function"].isidentifier()):
        raise ValueError("coding check: 'function' must be a Python identifier")
    tests = check.get("tests")
    if not (isinstance(tests, list) and tests and all(isinstance(t, str) and t.strip() for t in tests)):
        raise ValueError("coding check: 'tests' must be a non-empty list of code strings")
    for i, t in enumerate(tests):
        try:
            compile(t, f"test_{i}", "exec")
        except SyntaxError as e:
            raise ValueError(f"coding check: test {i} does not compile ({e.msg})") from None
    t = check.get("timeout_s", DEFAULT_TIMEOUT_S)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t <= 60:
        raise ValueError("coding check: 'timeout_s' must be a number in (0, 60]")
    unknown = set(check) - {"function", "tests", "timeout_s", "reference_solution"}
    if unknown:
        raise ValueError(f"coding check: unknown key(s) {sorted(unknown)}")


def extract_code(output: str, function: str) -> str:
    """The fenced python block defining ``function``, else all python / unlabelled fences, else the whole text."""
    blocks = [b for lang, b in fenced_blocks(output) if lang in ("python", "py", "python3", "")]
    defining = [b for b in blocks if f"def {function}" in b]
    if defining:
        return defining[0]
    return "\n".join(blocks) if blocks else output


def run_tests(code: str, function: str, tests: list[str], timeout_s: float) -> dict[str, Any]:
    """Run ``code`` then each test in a subprocess; the harness's result, or a timeout / crash description."""
    with tempfile.TemporaryDirectory(prefix="verispec-audit-") as tmp:
        spec = {"code": code, "function": function, "tests": tests, "mark": _MARK,
                "memory": MEMORY_LIMIT_BYTES, "cpu_s": int(timeout_s) + 2}
        Path(tmp, "spec.json").write_text(json.dumps(spec), encoding="utf-8")
        Path(tmp, "harness.py").write_text(_HARNESS, encoding="utf-8")
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1",
               "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}  # thread pools reserve address space
        posix = os.name == "posix"
        proc = subprocess.Popen(
            [sys.executable, "-I", "harness.py"], cwd=tmp, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            start_new_session=posix)
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            return {"timeout": True, "passed": 0, "total": len(tests), "error": f"timed out after {timeout_s} s"}
    lines = [ln for ln in out.splitlines() if ln.startswith(_MARK)]
    if not lines:
        return {"passed": 0, "total": len(tests), "returncode": proc.returncode,
                "error": f"the process died (exit {proc.returncode}): {err.strip()[-300:]}"}
    return json.loads(lines[-1][len(_MARK):])


def _kill(proc: subprocess.Popen) -> None:
    try:
        if os.name == "posix":
            os.killpg(proc.pid, signal.SIGKILL)
        else:
            proc.kill()
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()


def grade(check: dict[str, Any], output: str) -> Grade:
    validate(check)
    code = extract_code(output, check["function"])
    res = run_tests(code, check["function"], list(check["tests"]),
                    float(check.get("timeout_s", DEFAULT_TIMEOUT_S)))
    ok = res.get("passed", 0) == len(check["tests"])
    return Grade(float(ok), ok, res)
