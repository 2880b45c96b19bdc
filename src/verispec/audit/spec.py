"""What `verispec audit --candidate / --reference` compare: a SPEC names one side.

A SPEC is one of
- `plain`: our engine without speculation (on `--model`); `plain,dtype=float32` names its weight path;
- comma-separated `key=value` pairs or a JSON object for our engine, in process:
  `method=ngram,k=4,dtype=float32`, `{"method": "draft_model", "drafter": "./small", "k": 4}`; keys in `ENGINE_KEYS`;
- an OpenAI-compatible endpoint: `url=http://host:port/v1,model=NAME[,key=API_KEY]` (or the same as JSON).
Values are checked here, before any model loads or request goes out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Union

from verispec.config import QUANTIZATIONS, SPEC_METHODS

DTYPES = ("auto", "float32", "bfloat16", "float16")
SCHEDULERS = ("static", "goodput", "dspark")
RULES = ("exact", "threshold", "typical")
ENGINE_KEYS = ("method", "k", "drafter", "scheduler", "rule", "threshold_single", "threshold_acc", "dtype",
               "quantization", "adaptive", "invariant", "model", "label", "truncate")
ENDPOINT_KEYS = ("url", "model", "key", "label")
_ALIASES = {"num_speculative_tokens": "k", "draft_model": "drafter", "acceptance_rule": "rule", "api_key": "key"}


# An in-process audit's engine: requests decoding together, and KV positions per request (its items are short).
AUDIT_MAX_NUM_SEQS = 8
AUDIT_MAX_MODEL_LEN = 2048

@dataclass(frozen=True)
class EngineSpec:
    """Our engine in process: target `model` (None: the command's --model), weight path and speculation."""

    method: str = "none"
    k: int | None = None  # draft tokens per step (None: SpeculativeConfig's default)
    drafter: str | None = None  # draft model / trained drafter directory or shipped name
    scheduler: str | None = None  # None: LLM's default for the method
    rule: str = "exact"  # acceptance rule; threshold / typical are lossy
    threshold_single: float = 1.0
    threshold_acc: float = 1.0
    dtype: str = "auto"
    quantization: str | None = None
    adaptive: bool | None = None
    invariant: bool | None = None
    model: str | None = None
    label: str | None = None
    truncate: int | None = None  # every output cut to its first N tokens: a degraded candidate, the negative control

    def __post_init__(self) -> None:
        _check_choice("method", self.method, SPEC_METHODS)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("rule", self.rule, RULES)
        if self.scheduler is not None:
            _check_choice("scheduler", self.scheduler, SCHEDULERS)
        if self.quantization is not None:
            _check_choice("quantization", self.quantization, QUANTIZATIONS)
        if self.k is not None and not (isinstance(self.k, int) and 1 <= self.k <= 64):
            raise ValueError(f"SPEC key k must be an integer in 1..64, got {self.k!r}")
        if self.truncate is not None and not (isinstance(self.truncate, int) and self.truncate >= 1):
            raise ValueError(f"SPEC key truncate must be a positive integer (tokens kept), got {self.truncate!r}")
        for name in ("threshold_single", "threshold_acc"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"SPEC key {name} must be a number in (0, 1], got {v!r}")
        if self.method == "none" and (self.k is not None or self.drafter or self.rule != "exact"):
            raise ValueError("SPEC: k, drafter and rule need a speculative method (method=ngram, suffix, ...)")
        if self.method == "draft_model" and not self.drafter:
            raise ValueError("SPEC: method=draft_model needs drafter=PATH (the draft model)")

    @property
    def lossy(self) -> bool:
        return self.rule == "typical" or (self.rule == "threshold" and min(self.threshold_single,
                                                                             self.threshold_acc) < 1)

    def speculative_config(self) -> dict[str, Any] | None:
        """The LLM's speculative_config (None for plain decoding)."""
        if self.method == "none":
            return None
        cfg: dict[str, Any] = {"method": self.method}
        if self.k is not None:
            cfg["num_speculative_tokens"] = self.k
        if self.drafter:
            cfg["model"] = self.drafter
        if self.adaptive is not None:
            cfg["adaptive"] = self.adaptive
        if self.rule != "exact":
            cfg.update(acceptance_rule=self.rule, threshold_single=self.threshold_single,
                       threshold_acc=self.threshold_acc)
        return cfg

    def weights_key(self, default_model: str) -> tuple:
        """Sides with equal keys share one loaded target (same weights, path and KV cache)."""
        return (self.model or default_model, self.dtype, self.quantization, self.invariant)

    def describe(self) -> str:
        if self.label:
            return self.label
        parts = ["plain" if self.method == "none" else f"method={self.method}"]
        for name in ("k", "drafter", "scheduler", "adaptive", "quantization", "invariant", "model", "truncate"):
            v = getattr(self, name)
            if v is not None:
                parts.append(f"{name}={v}")
        if self.rule != "exact":
            parts.append(f"rule={self.rule},threshold_single={self.threshold_single:g},"
                         f"threshold_acc={self.threshold_acc:g} (LOSSY)")
        parts.append(f"dtype={self.dtype}")
        return ",".join(parts)


@dataclass(frozen=True)
class EndpointSpec:
    """An OpenAI-compatible server, driven through /v1/chat/completions."""

    url: str
    model: str | None = None  # None: the first id of GET /v1/models
    key: str | None = None
    label: str | None = None

    def __post_init__(self) -> None:
        if not (self.url.startswith("http://") or self.url.startswith("https://")):
            raise ValueError(f"SPEC url must start with http:// or https://, got {self.url!r}")

    def describe(self) -> str:
        return self.label or f"endpoint {self.url}" + (f" model {self.model}" if self.model else "")


Spec = Union[EngineSpec, EndpointSpec]


def _check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"SPEC key {key}={value!r} is not one of {', '.join(map(str, choices))}")


def _pairs(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, eq, value = part.partition("=")
        if part.strip() == "plain":  # `plain,dtype=float32`
            key, eq, value = "method", "=", "none"
        if not eq or not key.strip():
            raise ValueError(f"SPEC part {part!r} is not key=value (e.g. method=ngram,k=4 or "
                             "url=http://host:port/v1,model=NAME; or `plain`)")
        key = key.strip()
        if key in out:
            raise ValueError(f"SPEC key {key!r} given twice")
        out[key] = value.strip()
    return out


def _typed(key: str, value: Any) -> Any:
    """Strings from key=value text to the field's type (JSON values must already have it)."""
    if not isinstance(value, str):
        return value
    if key in ("k", "truncate"):
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"SPEC key {key} must be an integer, got {value!r}") from None
    if key in ("threshold_single", "threshold_acc"):
        try:
            return float(value)
        except ValueError:
            raise ValueError(f"SPEC key {key} must be a number, got {value!r}") from None
    if key in ("adaptive", "invariant"):
        low = value.lower()
        if low not in ("true", "false", "1", "0", "yes", "no"):
            raise ValueError(f"SPEC key {key} must be true or false, got {value!r}")
        return low in ("true", "1", "yes")
    return value


def parse_spec(text: str) -> Spec:
    """`plain`, `key=value,...` or a JSON object -> an EngineSpec or, when it has a url, an EndpointSpec."""
    s = text.strip()
    if not s:
        raise ValueError("empty SPEC: use `plain`, `method=ngram,k=4` or `url=http://host:port/v1,model=NAME`")
    if s == "plain":
        return EngineSpec()
    if s.startswith("{"):
        try:
            raw = json.loads(s)
        except json.JSONDecodeError as e:
            raise ValueError(f"SPEC is not valid JSON ({e.msg}): {s[:80]!r}") from None
        if not isinstance(raw, dict):
            raise ValueError("a JSON SPEC must be an object")
    else:
        raw = _pairs(s)
    fields = {_ALIASES.get(k, k): v for k, v in raw.items()}
    if "url" in fields:
        unknown = sorted(set(fields) - set(ENDPOINT_KEYS))
        if unknown:
            raise ValueError(f"unknown endpoint SPEC key(s) {', '.join(unknown)}; known: {', '.join(ENDPOINT_KEYS)}")
        if not all(isinstance(v, str) for v in fields.values()):
            raise ValueError("endpoint SPEC values must be strings")
        return EndpointSpec(**fields)
    unknown = sorted(set(fields) - set(ENGINE_KEYS))
    if unknown:
        raise ValueError(f"unknown SPEC key(s) {', '.join(unknown)}; engine keys: {', '.join(ENGINE_KEYS)}; an "
                         f"endpoint needs url= (keys {', '.join(ENDPOINT_KEYS)})")
    typed = {k: _typed(k, v) for k, v in fields.items()}
    if typed.get("method") == "plain":
        typed["method"] = "none"
    return EngineSpec(**typed)
