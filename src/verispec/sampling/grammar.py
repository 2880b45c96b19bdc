"""Structured outputs: vLLM's `StructuredOutputsParams` (json / regex / choice / grammar / json_object), compiled for
one tokenizer, and a per-request matcher the engine asks for token masks, draft cuts and forced tokens.

The grammar engine is llguidance (PyPI `llguidance`), not a parser of our own. xgrammar was measured beside it on
the default model's 49,152-token vocabulary (benchmarks/grammar_engines.py; figures in
docs/results/structured_outputs.md). Both compile a schema in milliseconds and fill a mask in microseconds, far
below one target forward; llguidance was chosen because it
  - installs alone (one abi3 wheel, no dependencies; xgrammar's Linux x86_64 wheel pulls triton and tvm-ffi),
  - works in tokens where speculation needs them: `validate_tokens` (how much of a draft the grammar allows, the
    draft cut), `rollback` (rejected drafts), `compute_ff_tokens` (the tokens the grammar forces next, in the
    tokenizer's own tokenization: the free drafts of jump-forward); xgrammar's jump-forward gives a string that
    would have to be re-tokenized,
  - takes JSON schema, regular expressions, Lark and GBNF grammars (llama.cpp's format, converted by llguidance).

A `Matcher` holds one request's committed output. Speculation walks it over the draft and back (`masks`), so its
state after every engine step is exactly the committed tokens' (the state oracle's `check_matcher` rebuilds it).
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

# JSON as the compiler writes it: no free whitespace (a small model given free whitespace can emit it forever, and
# fixed separators are what the grammar forces, so they become free drafts), OpenAI's separators
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
FLEXIBLE_JSON_OPTIONS = {"whitespace_flexible": True}
KINDS = ("json", "regex", "choice", "grammar", "json_object")


class GrammarError(ValueError):
    """A schema or grammar that cannot be compiled; the message says what is wrong (the server's 400)."""


@dataclass(frozen=True)
class StructuredOutputsParams:
    """vLLM's `StructuredOutputsParams`: exactly one of json (a JSON schema, dict or string), regex, choice (a list
    of strings), grammar (Lark or GBNF / EBNF text) or json_object=True (any JSON object).
    disable_any_whitespace: vLLM's flag; here JSON has fixed separators unless any_whitespace=True."""

    json: Any = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = True
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise GrammarError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        set_ = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise GrammarError(f"structured_outputs takes exactly one of {', '.join(KINDS)}; got "
                               f"{', '.join(set_) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str, bool)):
            raise GrammarError("structured_outputs.json must be a JSON schema (an object or its JSON text)")
        for k in ("regex", "grammar"):
            if getattr(self, k) is not None and not isinstance(getattr(self, k), str):
                raise GrammarError(f"structured_outputs.{k} must be a string")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> str:
        """A stable text key of the spec (compiled grammars are cached by it)."""
        value = getattr(self, self.kind)
        return json.dumps([self.kind, value, self.any_whitespace], sort_keys=True, default=list)

    @classmethod
    def from_any(cls, v: Any) -> "StructuredOutputsParams | None":
        """None, an instance, or a dict of the same fields (as SamplingParams(structured_outputs={...}) takes)."""
        if v is None or isinstance(v, cls):
            return v
        if isinstance(v, dict):
            unknown = set(v) - {"json", "regex", "choice", "grammar", "json_object", "disable_any_whitespace",
                                "any_whitespace"}
            if unknown:
                raise GrammarError(f"structured_outputs: unknown field(s) {', '.join(sorted(unknown))}")
            return cls(**v)
        raise GrammarError("structured_outputs must be a StructuredOutputsParams or a dict of its fields")


def _llg():
    import llguidance

    return llguidance


def grammar_text(spec: StructuredOutputsParams) -> str:
    """The spec as an llguidance grammar definition (not yet checked against a tokenizer)."""
    llg = _llg()
    opts = FLEXIBLE_JSON_OPTIONS if spec.any_whitespace else JSON_OPTIONS
    kind = spec.kind
    try:
        if kind == "json_object":
            return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=opts)
        if kind == "json":
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, (dict, bool)):
                raise GrammarError("the JSON schema must be a JSON object")
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        if kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if kind == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        return llg.grammar_from("grammar", spec.grammar)
    except GrammarError:
        raise
    except (ValueError, TypeError) as e:
        raise GrammarError(f"structured_outputs.{kind}: {e}") from None


class GrammarCompiler:
    """One tokenizer's grammar compiler: specs -> checked grammars (cached by `StructuredOutputsParams.key`) and
    matchers over them. Building llguidance's tokenizer takes about a second, so it happens at the first use."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.hf_tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._tok = None
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()

    @property
    def tokenizer(self):
        with self._lock:
            if self._tok is None:
                import llguidance.hf

                eos = self.eos_ids[0] if len(self.eos_ids) == 1 else self.eos_ids
                self._tok = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            return self._tok

    def compile(self, spec: StructuredOutputsParams) -> str:
        """The checked grammar of `spec`; GrammarError naming the problem for a bad schema, regex or grammar."""
        key = spec.key()
        got = self._cache.get(key)
        if got is not None:
            return got
        grammar = grammar_text(spec)
        err = _llg().LLMatcher.validate_grammar(grammar, self.tokenizer)
        if err:
            raise GrammarError(f"structured_outputs.{spec.kind} is not valid: {err.strip().splitlines()[0]}")
        if len(self._cache) > 256:
            self._cache.clear()
        self._cache[key] = grammar
        return grammar

    def matcher(self, spec: StructuredOutputsParams) -> "Matcher":
        return Matcher(_llg().LLMatcher(self.tokenizer, self.compile(spec), log_level=0), self.vocab_size,
                       self.eos_ids)


class Matcher:
    """One request's grammar state over its committed output tokens."""

    def __init__(self, m: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.m, self.vocab_size, self.eos_ids = m, vocab_size, list(eos_ids)
        self.consumed = 0  # committed tokens the matcher holds

    def _mask(self) -> np.ndarray:
        """[V] bool: the tokens the grammar allows next (only EOS once it is complete or stopped)."""
        if self.m.is_stopped() or self.m.is_error():
            allowed = np.zeros(self.vocab_size, dtype=bool)
            allowed[self.eos_ids] = True
            return allowed
        bits = np.frombuffer(self.m.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].view(bool)
        if not allowed.any():  # nothing the grammar takes: end the output rather than sample from nothing
            allowed[self.eos_ids] = True
        return allowed

    def masks(self, prefixes: Sequence[Sequence[int]]) -> np.ndarray:
        """[len(prefixes), V] the allowed tokens after the committed output followed by each prefix (draft tokens
        the grammar allows); the state is the committed output's again afterwards."""
        out = np.empty((len(prefixes), self.vocab_size), dtype=bool)
        for i, prefix in enumerate(prefixes):
            n = self._walk(prefix)
            out[i] = self._mask()
            self._back(n)
        return out

    def chain_masks(self, draft: Sequence[int]) -> np.ndarray:
        """[g + 1, V] the masks after draft[:i] for i = 0..g, one walk (the draft must be allowed: `valid_prefix`)."""
        out = np.empty((len(draft) + 1, self.vocab_size), dtype=bool)
        n = 0
        for i in range(len(draft) + 1):
            out[i] = self._mask()
            if i < len(draft):
                n += self._advance(draft[i])
        self._back(n)
        return out

    def _advance(self, token: int) -> int:
        """Consume one allowed draft token; returns how many tokens the matcher's history grew by: 0 for EOS once
        stopped (llguidance takes it without a history entry, so rolling it back would undo one token too
        many), else 1."""
        if self.m.is_stopped() and int(token) in self.eos_ids:
            return 0
        if not self.m.consume_token(int(token)):
            raise AssertionError(f"draft token {token} was not allowed: cut the draft first")
        return 1

    def allows(self, token: int) -> bool:
        """Whether the next-token mask (`_mask`) would allow `token`, without filling the mask (about 1 us against
        about 200 on average): the grammar takes it (`validate_tokens`) and forces no bytes here. Where bytes are
        forced, llguidance's mask keeps only the tokens of their own tokenization, which `validate_tokens` does not
        check; there, and once stopped, this says False and the caller fills the mask."""
        m = self.m
        if m.is_stopped() or m.is_error() or m.validate_tokens([int(token)]) != 1:
            return False
        return not m.compute_ff_bytes()

    def chain_picks(self, draft: Sequence[int], picks: Sequence[int]) -> list[np.ndarray | None]:
        """For i = 0..g (g = len(draft)): None where picks[i] is allowed after draft[:i] (`allows`), else the mask
        there ([V] bool, as `chain_masks` row i). One walk; the draft must be allowed (`valid_prefix`)."""
        out: list[np.ndarray | None] = []
        n = 0
        for i in range(len(draft) + 1):
            out.append(None if self.allows(picks[i]) else self._mask())
            if i < len(draft):
                n += self._advance(draft[i])
        self._back(n)
        return out

    def _walk(self, tokens: Sequence[int]) -> int:
        n = 0
        for t in tokens:
            try:
                n += self._advance(t)
            except AssertionError:
                self._back(n)
                raise AssertionError("a draft path the grammar forbids reached the mask: cut it first") from None
        return n

    def _back(self, n: int) -> None:
        if n and not self.m.rollback(n):
            raise AssertionError(f"the grammar matcher could not roll back {n} tokens: {self.m.get_error()}")

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` the grammar allows after the committed output (a draft is cut there)."""
        if not tokens or self.m.is_stopped():
            return 0
        return int(self.m.validate_tokens([int(t) for t in tokens]))

    def forced(self, k: int) -> list[int]:
        """Up to k tokens the grammar forces next (llguidance's fast-forward tokens: the only bytes it allows, in
        the tokenizer's tokenization); empty where it allows a choice."""
        if k <= 0 or self.m.is_stopped() or self.m.is_error():
            return []
        return [int(t) for t in self.m.compute_ff_tokens()[:k]]

    def forced_after(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the grammar forces after the committed output followed by `tokens` (which it must allow:
        `valid_prefix`); the state is the committed output's again afterwards."""
        if k <= 0:
            return []
        n = self._walk(tokens)
        try:
            return self.forced(k)
        finally:
            self._back(n)

    def commit(self, tokens: Sequence[int]) -> None:
        """The verified tokens, appended to the committed output; an EOS the grammar allows ends it."""
        for t in tokens:
            if self.m.is_stopped():
                break  # past the grammar's end only EOS comes, and the request stops at it
            if not self.m.consume_token(int(t)):
                raise AssertionError(f"committed token {t} is not allowed by the grammar: {self.m.get_error()}")
            self.consumed += 1

    @property
    def accepting(self) -> bool:
        return bool(self.m.is_accepting())

    def state_key(self) -> tuple[bool, bool, bytes]:
        """What the state oracle compares: stopped, accepting and the next mask."""
        return bool(self.m.is_stopped()), self.accepting, self._mask().tobytes()
