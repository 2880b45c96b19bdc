"""vLLM's sampling controls on the target's logits, as pure functions: bad_words, min_tokens, logit_bias, then the
presence / frequency / repetition penalties (vLLM's order; its grammar mask comes before all of them).

Definitions (vLLM's, which follow OpenAI's and transformers'):
  repetition_penalty r - a token that occurs in the prompt or the output so far: a positive logit divided by r,
                         any other multiplied by r (transformers' RepetitionPenaltyLogitsProcessor over both);
  frequency_penalty f  - logit -= f x (times the token occurs in the output so far);
  presence_penalty p   - logit -= p x (1 if it occurs in the output so far);
  logit_bias           - {token id: bias} added to the logits;
  min_tokens n         - EOS and stop_token_ids get -inf while the output has fewer than n tokens;
  bad_words            - per word, its token sequences (with and without a leading space): the last token gets -inf
                         where the output so far ends with the ones before it (a one-token word always).
Under speculation "the output so far" at draft position i is the committed output followed by draft tokens 1..i-1
(`processor.py` applies these row by row).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias


def neutral(p: Any) -> bool:
    """The controls of SamplingParams `p` change nothing."""
    return (p.presence_penalty == 0 and p.frequency_penalty == 0 and p.repetition_penalty == 1 and not p.logit_bias
            and p.min_tokens == 0 and not p.bad_words)


def check_controls(presence: Any, frequency: Any, repetition: Any, logit_bias: Any, min_tokens: Any,
                   bad_words: Any) -> tuple[dict[int, float], tuple[str, ...]]:
    """ValueError naming the field for a value vLLM would refuse; returns logit_bias as {int: float} and bad_words
    as a tuple."""
    for name, v in (("presence_penalty", presence), ("frequency_penalty", frequency)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -2 <= v <= 2:
            raise ValueError(f"{name} must be a number in [-2, 2], got {v!r}")
    if isinstance(repetition, bool) or not isinstance(repetition, (int, float)) or not 0 < repetition <= 2:
        raise ValueError(f"repetition_penalty must be a number in (0, 2], got {repetition!r}")
    if isinstance(min_tokens, bool) or not isinstance(min_tokens, int) or min_tokens < 0:
        raise ValueError(f"min_tokens must be an integer >= 0, got {min_tokens!r}")
    bias: dict[int, float] = {}
    if logit_bias:
        if not isinstance(logit_bias, Mapping):
            raise ValueError("logit_bias must map token ids to numbers")
        for k, v in logit_bias.items():
            try:
                tid = int(k)
            except (TypeError, ValueError):
                raise ValueError(f"logit_bias keys must be token ids, got {k!r}") from None
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}")
            bias[tid] = float(v)
    words = (bad_words,) if isinstance(bad_words, str) else tuple(bad_words or ())
    if not all(isinstance(w, str) and w.strip() for w in words):
        raise ValueError("bad_words must be a list of non-empty strings")
    return bias, words


def bad_word_sequences(words: Sequence[str], encode) -> list[list[int]]:
    """vLLM's token sequences of `words`: each word (leading spaces stripped) encoded as it is and after a space;
    the spaced form is kept where it starts with another token and has as many tokens (a word of its own)."""
    seqs: list[list[int]] = []
    for word in words:
        plain = list(encode(word.lstrip()))
        seqs.append(plain)
        spaced = list(encode(" " + word.lstrip()))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            seqs.append(spaced)
    return [s for s in seqs if s]


def apply_row(row: torch.Tensor, p: Any, output: Sequence[int], counts: torch.Tensor | None,
              prompt_mask: torch.Tensor | None, stop_ids: Sequence[int], bad: Sequence[Sequence[int]]) -> None:
    """One position's controls on `row` ([V] float32) in place. output: the output before this position;
    counts: [V] occurrences of each token in it (None without frequency / presence / repetition penalties);
    prompt_mask: [V] bool, the prompt's tokens (repetition penalty); stop_ids: EOS and stop_token_ids."""
    for seq in bad:
        n = len(seq) - 1
        if n == 0 or (len(output) >= n and list(output[len(output) - n:]) == list(seq[:-1])):
            row[seq[-1]] = float("-inf")
    if len(output) < p.min_tokens and stop_ids:
        row[list(stop_ids)] = float("-inf")
    for tid, b in (p.logit_bias or {}).items():
        row[tid] += b
    if counts is None:
        return
    if p.repetition_penalty != 1:
        seen = counts > 0
        if prompt_mask is not None:
            seen = seen | prompt_mask
        scale = torch.where(row > 0, 1.0 / p.repetition_penalty, p.repetition_penalty)
        row.copy_(torch.where(seen, row * scale, row))
    if p.frequency_penalty:
        row.sub_(p.frequency_penalty * counts)
    if p.presence_penalty:
        row.sub_(p.presence_penalty * (counts > 0).float())
