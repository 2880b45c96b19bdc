"""One request's logits processing under speculation: the grammar mask and the sampling controls, applied to the
target's logits row by row before the verification rule sees them, so every verified position is drawn from (or,
greedy, the argmax of) the same processed distribution plain decoding would use there.

Row i of a verified block predicts the token after the committed output followed by draft tokens 1..i: its mask is
the grammar's state after those tokens, its penalties count them as output. Drafts are cut at the first token the
grammar forbids before verification (`cut`), and the tokens the grammar forces are offered as drafts of their own
(`forced`). `commit` then appends the verified tokens; the matcher never holds an unverified token between steps.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from verispec.sampling.controls import apply_row, bad_word_sequences, neutral
from verispec.sampling.grammar import GrammarCompiler, GrammarError, Matcher, StructuredOutputsParams


class RequestProcessor:
    """The per-request state: its matcher (None without structured outputs) and what the controls need."""

    def __init__(self, params: Any, prompt_ids: Sequence[int], vocab_size: int, stop_ids: Sequence[int],
                 matcher: Matcher | None, bad: list[list[int]]) -> None:
        self.params, self.vocab_size, self.matcher, self.bad = params, vocab_size, matcher, bad
        self.stop_ids = sorted(set(stop_ids))
        self.controls = not neutral(params)
        self.penalties = (params.repetition_penalty != 1 or params.frequency_penalty != 0
                          or params.presence_penalty != 0)
        self.prompt_mask = None
        if params.repetition_penalty != 1:
            self.prompt_mask = torch.zeros(vocab_size, dtype=torch.bool)
            self.prompt_mask[torch.tensor(list(prompt_ids), dtype=torch.long)] = True

    def forced(self, k: int) -> list[int]:
        """Up to k tokens the grammar forces next (none without a grammar)."""
        return self.matcher.forced(k) if self.matcher is not None else []

    def forced_after(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens the grammar forces once `tokens` (allowed: `cut`) follow the output (none without one)."""
        return self.matcher.forced_after(tokens, k) if self.matcher is not None else []

    def cut(self, tokens: Sequence[int]) -> int:
        """How many leading draft tokens the grammar allows (all of them without a grammar)."""
        return self.matcher.valid_prefix(tokens) if self.matcher is not None else len(tokens)

    def process(self, logits: torch.Tensor, output: Sequence[int], draft: Sequence[int],
                paths: Sequence[Sequence[int]] | None = None) -> torch.Tensor:
        """logits: [rows, V] raw target logits of a verified block -> processed float32 logits (a copy).
        A chain: row i follows draft[:i]. A tree: row i follows paths[i] (the root's is empty).

        The controls come first, then the mask: each control maps a logit on its own and keeps -inf at -inf, so
        the order does not change a bit. A greedy chain's rows are masked only where needed: where a row's
        argmax is a token the mask allows (`Matcher.allows`, about 1 us), the masked row's argmax is that same
        token (masking only lowers logits to -inf, and the first maximum stays the first), so the row is left
        as it is and the mask (about 200 us on a 49k vocabulary) is not filled. Sampled rows and trees are always
        masked: their whole distribution is read."""
        rows = logits.float().clone()
        prefixes = [list(draft[:i]) for i in range(rows.shape[0])] if paths is None else [list(p) for p in paths]
        if self.controls:
            base = self._counts(output) if self.penalties else None
            for i, prefix in enumerate(prefixes):
                counts = None
                if base is not None:
                    counts = base.clone()
                    if prefix:
                        counts.index_add_(0, torch.tensor(prefix, dtype=torch.long), torch.ones(len(prefix)))
                apply_row(rows[i], self.params, list(output) + prefix, counts, self.prompt_mask, self.stop_ids,
                          self.bad)
        if self.matcher is None:
            return rows
        v = rows.shape[1]
        if paths is None and self.params.greedy:
            picks = rows.numpy().argmax(axis=1).tolist()  # [rows]; numpy's is ~10x faster than torch's on a row
            for i, allowed in enumerate(self.matcher.chain_picks(draft, picks)):
                if allowed is not None:
                    rows[i].masked_fill_(torch.from_numpy(allowed[:v]).logical_not(), float("-inf"))
            return rows
        allowed = self.matcher.chain_masks(draft) if paths is None else self.matcher.masks(prefixes)  # [rows, V]
        rows.masked_fill_(torch.from_numpy(allowed[:, :v]).logical_not(), float("-inf"))
        return rows

    def _counts(self, output: Sequence[int]) -> torch.Tensor:
        counts = torch.zeros(self.vocab_size, dtype=torch.float32)
        if output:
            counts.index_add_(0, torch.tensor(list(output), dtype=torch.long), torch.ones(len(output)))
        return counts

    def commit(self, tokens: Sequence[int]) -> None:
        if self.matcher is not None:
            self.matcher.commit(tokens)


def needs_processor(params: Any) -> bool:
    return getattr(params, "structured_outputs", None) is not None or not neutral(params)


class ProcessorFactory:
    """Builds the processors of one model's requests: its tokenizer (grammars, bad words), vocabulary and EOS."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._compiler: GrammarCompiler | None = None

    @property
    def compiler(self) -> GrammarCompiler:
        if self.tokenizer is None:
            raise GrammarError("structured outputs need the model's tokenizer, and this model has none")
        if self._compiler is None:
            self._compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_ids)
        return self._compiler

    def validate(self, params: Any) -> None:
        """ValueError (GrammarError for the grammar) naming the problem, before the request runs: its grammar
        compiles, its logit_bias ids are in the vocabulary, its bad_words can be tokenized."""
        bad_ids = [t for t in (params.logit_bias or {}) if not 0 <= t < self.vocab_size]
        if bad_ids:
            raise ValueError(f"logit_bias holds token ids {bad_ids[:5]} outside the vocabulary [0, {self.vocab_size})")
        if params.bad_words and self.tokenizer is None:
            raise ValueError("bad_words need the model's tokenizer, and this model has none")
        if params.structured_outputs is not None:
            self.compiler.compile(params.structured_outputs)

    def new(self, params: Any, prompt_ids: Sequence[int]) -> RequestProcessor | None:
        """The request's processor, or None where nothing would change its logits."""
        if not needs_processor(params):
            return None
        self.validate(params)
        spec: StructuredOutputsParams | None = params.structured_outputs
        matcher = self.compiler.matcher(spec) if spec is not None else None
        bad = bad_word_sequences(params.bad_words, self._encode) if params.bad_words else []
        stop = [] if params.ignore_eos else self.eos_ids
        return RequestProcessor(params, prompt_ids, self.vocab_size, list(stop) + list(params.stop_token_ids),
                                matcher, bad)

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

