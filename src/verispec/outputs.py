"""What `LLM.generate` and `LLM.chat` return, in vLLM's shapes: a `RequestOutput` per request, its `outputs` one
`CompletionOutput` (verispec runs one completion per request)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from verispec.sampling.logprobs import Logprob

__all__ = ["CompletionOutput", "RequestOutput"]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | None = None  # the stop string that ended the text (vLLM's name)
    logprobs: list[dict[int, Logprob]] | None = None  # per token: {sampled id and top-N ids: Logprob}


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: dict[str, Any] = field(default_factory=dict)
    stop_reason: str | None = None  # the stop string that ended the text (cut before it unless include_stop_str...)
    # with SamplingParams(logprobs=N): per output token {sampled id, then the top-N ids: Logprob(logprob, rank,
    # decoded_token)}, vLLM's layout; logprobs are the log_softmax of the raw logits (vLLM's raw_logprobs)
    logprobs: list[dict[int, Logprob]] | None = None
    # with SamplingParams(return_hidden_states=layers): {layer: [len(prompt) + len(output) - 1, d]}, the model's
    # dtype: the target's state entering each layer at every fed position, as the forwards computed it
    hidden_states: dict[int, torch.Tensor] | None = None
    # LLM.chat with tools: the OpenAI tool calls parsed from `text` (verispec/tools.py), [] where it has none;
    # None without tools
    tool_calls: list[dict[str, Any]] | None = None

    @property
    def outputs(self) -> list[CompletionOutput]:
        """vLLM's layout: one completion per request."""
        return [CompletionOutput(0, self.text, self.token_ids, self.finish_reason, self.stop_reason, self.logprobs)]
