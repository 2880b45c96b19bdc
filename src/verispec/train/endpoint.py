"""Responses for `verispec train data --endpoint URL`: any OpenAI-compatible server of the same target (vLLM, SGLang,
`verispec serve`) answers the prompts; verispec then recomputes the hidden states locally.

Prompts go out as token ids on /v1/completions (so the server sees exactly the chat-templated ids), with vLLM's
`return_token_ids` so the response comes back as ids; a server that ignores it has its text re-tokenized (counted,
and recorded in the data's meta). Transport errors, 429 and 5xx are retried with backoff; other errors stop the run
with the server's message."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Sequence

import httpx

RETRIES = 4


def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Endpoint:
    url: str  # the server's base URL (with or without /v1)
    model: str  # the served model id
    tokenizer: Any = None  # re-tokenizes text when the server returns no token ids
    concurrency: int = 16
    api_key: str | None = None
    timeout_s: float = 600.0
    retokenized: int = 0  # responses that came back as text only
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def connect(cls, url: str, model: str | None = None, **kw: Any) -> "Endpoint":
        """Check the server answers /v1/models and pick the model (the only one served, or `model`)."""
        key = kw.get("api_key") or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        try:
            r = httpx.get(f"{_base(url)}/v1/models", headers=headers, timeout=30)
            r.raise_for_status()
        except httpx.HTTPError as e:
            raise ValueError(f"{url} does not answer GET /v1/models ({e}): is it an OpenAI-compatible server?") from e
        served = [m["id"] for m in r.json().get("data", [])]
        if model is None:
            if len(served) != 1:
                raise ValueError(f"{url} serves {served}: name one with --served-model")
            model = served[0]
        elif model not in served:
            raise ValueError(f"{url} does not serve {model!r} (it serves {served})")
        return cls(_base(url), model, **{**kw, "api_key": key})

    def describe(self) -> str:
        return f"endpoint:{self.model}"

    def respond(self, jobs: Sequence[tuple[list[int], str, int]], max_tokens: int, temperature: float
                ) -> list[list[int]]:
        """jobs: (prompt ids, "greedy" | "sampled", seed) -> each response's token ids, in job order."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        with httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout_s) as client, \
                ThreadPoolExecutor(max(1, self.concurrency)) as pool:
            return list(pool.map(lambda job: self._one(client, *job, max_tokens, temperature), jobs))

    def _one(self, client: httpx.Client, ids: list[int], mode: str, seed: int, max_tokens: int,
             temperature: float) -> list[int]:
        body: dict[str, Any] = {"model": self.model, "prompt": ids, "max_tokens": max_tokens,
                                "temperature": 0.0 if mode == "greedy" else temperature, "return_token_ids": True}
        if mode != "greedy":
            body["seed"] = seed
        choice = self._post(client, body)["choices"][0]
        if choice.get("token_ids") is not None:
            return [int(t) for t in choice["token_ids"]]
        if self.tokenizer is None:
            raise ValueError(f"{self.url} returned no token ids and there is no tokenizer to re-tokenize its text")
        with self._lock:
            self.retokenized += 1
        return list(self.tokenizer(choice["text"], add_special_tokens=False)["input_ids"])

    def _post(self, client: httpx.Client, body: dict) -> dict:
        for attempt in range(RETRIES + 1):
            try:
                r = client.post("/v1/completions", json=body)
            except httpx.TransportError as e:
                error = f"{type(e).__name__}: {e}"
            else:
                if r.status_code < 400:
                    return r.json()
                if r.status_code != 429 and r.status_code < 500:
                    raise ValueError(f"{self.url}/v1/completions refused a request ({r.status_code}): {r.text[:500]}")
                error = f"HTTP {r.status_code}"
            if attempt < RETRIES:
                time.sleep(min(30.0, 0.5 * 2**attempt))
        raise ValueError(f"{self.url}/v1/completions failed {RETRIES + 1} times (last: {error})")
