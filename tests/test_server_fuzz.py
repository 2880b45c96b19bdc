"""Schemathesis fuzzes every operation of the served /openapi.json (tiny random Llama): no request, valid or not by
the schema, may get a 5xx. The schema's max_tokens and n maximums are lowered here so every generated request
stays a few forwards long.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.generation.modes import GenerationMode  # noqa: E402

from tests.helpers import make_app  # noqa: E402

FAST = {"max_tokens": 6, "max_completion_tokens": 6, "n": 3}


def _lower_limits(raw: dict, model: str) -> dict:
    """Small max_tokens and n, and `model` the served id (any other name is a 404, tested in test_server.py), so
    most generated requests reach the engine."""
    schema = copy.deepcopy(raw)
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schema["components"]["schemas"][name]["properties"]
        props["model"] = {"enum": [model, None]}
        for key, hi in FAST.items():
            if key in props:
                props[key]["anyOf"][0]["maximum"] = hi
    return schema


@pytest.fixture(scope="module")
def api_schema(tiny_dir: Path) -> Iterator[object]:
    app, engine = make_app(tiny_dir, manage_engine=False)  # schemathesis keeps the app's lifespan to the end
    engine.start()
    raw = app.openapi()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= set(raw["paths"])
    schema = schemathesis.openapi.from_dict(_lower_limits(raw, app.state.served.id))
    schema.app = app
    try:
        yield schema
    finally:
        engine.shutdown()


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_no_server_errors(api_schema, mode: str) -> None:
    """30 generated requests per operation, fitting the schema (positive) or breaking it (negative: wrong types,
    out-of-range values, missing fields); a 5xx fails with schemathesis' reproduction (a curl command)."""
    ops = [r.ok() for r in api_schema.get_all_operations()]
    assert {op.label for op in ops} >= {"POST /v1/completions", "POST /v1/chat/completions"}
    for op in ops:
        if mode == "negative" and op.method.upper() != "POST":  # nothing to break in the others' inputs
            continue

        @given(case=op.as_strategy(GenerationMode(mode)))
        @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def run(case) -> None:
            case.call_and_validate(checks=[not_a_server_error])

        run()
