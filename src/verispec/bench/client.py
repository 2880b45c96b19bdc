"""An async streaming client for any OpenAI-compatible endpoint (verispec serve, vLLM, SGLang, llama.cpp's server),
recording what a serving benchmark needs per request.

Definitions (docs/measuring.md), all measured on this client's monotonic clock, from the moment the request is handed to
the HTTP client ("send"):

- TTFT = time of the first chunk that carries output (text or token ids) - send.
- E2E = time of the last chunk that carries output - send (a request with no output: end of the stream - send).
  The stream's end (`[DONE]` / close) is kept as its own figure, `stream_end_s`.
- TPOT = (E2E - TTFT) / (N_out - 1), only when N_out > 1.
- raw inter-chunk gap = time between two consecutive output-carrying chunks.
- per-token ITL: a gap before a chunk that carries n tokens counts as n tokens of gap / n each.
- time to headers = arrival of the response's status line and headers - send. The closest a client gets to
  queueing time: servers that answer headers before scheduling the request (verispec, vLLM) make it an upper
  bound on connection + admission, not the time spent waiting for a batch slot.

Token counts per chunk come, best first, from the `token_ids` of each chunk (verispec's and vLLM's
`return_token_ids` extension), from per-chunk cumulative usage (vLLM's `stream_options.continuous_usage_stats`),
from the final usage (`stream_options.include_usage`: exact total, per-chunk split assumed even), or, when the
server gives none of these, from counting chunks (one token per output chunk). Each record says which
(`token_source`): this client never re-tokenises. `probe()` finds out, once per endpoint, which extensions the
server accepts.

Error classes: `http_<status>` (the server answered an error status), `timeout` (the request's own timeout, or
cancelled at the end of a bounded benchmark level), `connection` (could not connect / connection dropped),
`stream` (malformed SSE, an error event in the stream, or a stream that ended without `[DONE]`), and `client`
(anything else that failed on this side, recorded by the sweep rather than lost).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

TOKEN_SOURCES = ("token_ids", "continuous_usage", "usage_total", "chunks")
ERROR_CLASSES = ("timeout", "connection", "stream", "client")  # plus http_<status>


def base_url(url: str) -> str:
    """The server root: 'http://h:p', 'http://h:p/' and 'http://h:p/v1' all give 'http://h:p'."""
    u = url.strip().rstrip("/")
    return u[:-3] if u.endswith("/v1") else u


@dataclass
class Prompt:
    """One request to send: chat messages (for /v1/chat/completions) or a prompt string (for /v1/completions)."""

    id: str
    workload: str
    messages: list[dict[str, str]] | None = None
    prompt: str | None = None
    max_tokens: int = 128

    def text_prompt(self) -> str:
        if self.prompt is not None:
            return self.prompt
        return "\n\n".join(m["content"] for m in self.messages or [])


@dataclass
class Capabilities:
    """What the server accepted in the probe, i.e. how token counts will be obtained."""

    return_token_ids: bool = False  # accepted the extension and answered token_ids per chunk
    include_usage: bool = False  # final usage chunk
    continuous_usage: bool = False  # usage in every chunk
    probed: bool = False
    note: str = ""

    def extras(self) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if self.return_token_ids:
            body["return_token_ids"] = True
        if self.include_usage or self.continuous_usage:
            opts: dict[str, Any] = {"include_usage": True}
            if self.continuous_usage:
                opts["continuous_usage_stats"] = True
            body["stream_options"] = opts
        return body

    @property
    def token_source(self) -> str:
        if self.return_token_ids:
            return "token_ids"
        if self.continuous_usage:
            return "continuous_usage"
        if self.include_usage:
            return "usage_total"
        return "chunks"


@dataclass
class RequestRecord:
    """Everything measured about one request. Times in seconds; `send_at` is relative to the level start."""

    index: int
    prompt_id: str
    workload: str
    endpoint: str = ""
    level: str = ""
    repeat: int = 0
    send_at: float = float("nan")
    status: str = "pending"  # pending | ok | error
    error_class: str | None = None
    error: str | None = None
    http_status: int | None = None
    headers_s: float = float("nan")  # time to response headers ("queueing time where measurable")
    ttft_s: float = float("nan")
    e2e_s: float = float("nan")
    tpot_s: float = float("nan")
    stream_end_s: float = float("nan")
    n_out: int = 0
    n_chunks: int = 0  # output-carrying chunks
    prompt_tokens: int | None = None
    token_source: str = ""
    finish_reason: str | None = None
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per output-carrying chunk
    chunk_gaps_s: list[float] = field(default_factory=list)  # raw gaps between output-carrying chunks
    itl_s: list[float] = field(default_factory=list)  # per-token ITL (gap / tokens of the chunk, n copies)
    text: str = ""
    token_ids: list[int] | None = None
    identical: bool | None = None  # filled in by the sweep
    first_divergence: int | None = None
    identical_to_baseline: bool | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def fail(self, error_class: str, message: str) -> None:
        self.status, self.error_class, self.error = "error", error_class, message[:300]

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = None if v != v else round(v, 6)
            elif isinstance(v, list) and v and isinstance(v[0], float):
                d[k] = [round(x, 6) for x in v]
        return d


class StreamError(Exception):
    pass


def _usage_completion(obj: dict) -> int | None:
    u = obj.get("usage")
    if isinstance(u, dict) and isinstance(u.get("completion_tokens"), int):
        return u["completion_tokens"]
    return None


def finalize(rec: RequestRecord, t_send: float, chunk_times: list[float], final_usage: int | None) -> None:
    """Fill TTFT, E2E, TPOT, gaps and per-token ITL from the chunk arrival times and tokens per chunk."""
    if rec.token_source == "usage_total":
        # exact total from the usage chunk, spread evenly over the output chunks (stated in token_source)
        total = final_usage if final_usage is not None else len(chunk_times)
        n = len(chunk_times)
        rec.chunk_tokens = [total // n + (1 if i < total % n else 0) for i in range(n)] if n else []
        if final_usage is None:
            rec.token_source = "chunks"
    rec.n_chunks = len(chunk_times)
    rec.n_out = sum(rec.chunk_tokens)
    if chunk_times:
        rec.ttft_s = chunk_times[0] - t_send
        rec.e2e_s = chunk_times[-1] - t_send
    else:
        rec.e2e_s = rec.stream_end_s
    if rec.n_out > 1 and chunk_times:
        rec.tpot_s = (rec.e2e_s - rec.ttft_s) / (rec.n_out - 1)
    rec.chunk_gaps_s, rec.itl_s = [], []
    for i in range(1, len(chunk_times)):
        gap = chunk_times[i] - chunk_times[i - 1]
        rec.chunk_gaps_s.append(gap)
        n = rec.chunk_tokens[i]
        if n > 0:
            rec.itl_s += [gap / n] * n


class EndpointClient:
    """Streams requests to one OpenAI-compatible server. Use as `async with EndpointClient(...) as c:`."""

    def __init__(self, url: str, *, api: str = "chat", model: str | None = None, api_key: str | None = None,
                 max_connections: int = 256, request_timeout: float = 600.0, temperature: float = 0.0,
                 seed: int | None = None, ignore_eos: bool = False, extra_body: dict[str, Any] | None = None,
                 label: str = "") -> None:
        if api not in ("chat", "completions"):
            raise ValueError("api must be 'chat' or 'completions'")
        self.base = base_url(url)
        self.api, self.model, self.label = api, model, label or self.base
        self.temperature, self.seed, self.ignore_eos = temperature, seed, ignore_eos
        self.extra_body = dict(extra_body or {})
        self.caps = Capabilities()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.AsyncClient(
            base_url=self.base, headers=headers,
            timeout=httpx.Timeout(request_timeout, connect=min(30.0, request_timeout)),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections))

    async def __aenter__(self) -> "EndpointClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.http.aclose()

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.api == "chat" else "/v1/completions"

    async def models(self, timeout: float = 30.0) -> list[str]:
        r = await self.http.get("/v1/models", timeout=timeout)
        r.raise_for_status()
        return [m["id"] for m in r.json().get("data", [])]

    async def resolve_model(self, timeout: float = 30.0) -> str:
        """`model` if given, else the first id of GET /v1/models."""
        if not self.model:
            ids = await self.models(timeout)
            if not ids:
                raise RuntimeError(f"{self.base}/v1/models lists no model: pass --model")
            self.model = ids[0]
        return self.model

    async def reset_prefix_cache(self, timeout: float = 30.0, wait_s: float = 30.0) -> str:
        """Empty the server's prefix cache and return the route that did it: POST /reset_prefix_cache (verispec
        `serve --enable-dev-endpoints`, vLLM with VLLM_SERVER_DEV_MODE=1), else /flush_cache (SGLang). A server
        that refuses while requests run (409; SGLang: 400) is asked again for up to `wait_s` seconds."""
        deadline = time.perf_counter() + wait_s
        for route in ("/reset_prefix_cache", "/flush_cache"):
            while True:
                r = await self.http.post(route, timeout=timeout)
                if r.status_code < 300:
                    return route
                if r.status_code in (404, 405):
                    break
                if r.status_code in (400, 409) and time.perf_counter() < deadline:
                    await asyncio.sleep(0.2)
                    continue
                raise RuntimeError(f"{self.base}{route} answered {r.status_code}: {r.text[:200]}")
        raise RuntimeError(f"{self.base} has no prefix-cache reset route (POST /reset_prefix_cache or /flush_cache): "
                           "start verispec serve with --enable-dev-endpoints, vLLM with VLLM_SERVER_DEV_MODE=1")

    def body(self, p: Prompt, max_tokens: int | None = None, extras: dict[str, Any] | None = None) -> dict[str, Any]:
        b: dict[str, Any] = {"model": self.model, "max_tokens": max_tokens or p.max_tokens,
                             "temperature": self.temperature, "stream": True}
        if self.api == "chat":
            b["messages"] = list(p.messages) if p.messages else [{"role": "user", "content": p.text_prompt()}]
        else:
            b["prompt"] = p.text_prompt()
        if self.seed is not None:
            b["seed"] = self.seed
        if self.ignore_eos:
            b["ignore_eos"] = True
        b.update(self.extra_body)
        b.update(self.caps.extras() if extras is None else extras)
        return b

    async def probe(self, prompt: Prompt, timeout: float = 60.0) -> Capabilities:
        """Find which token-count extensions the server takes: one short streamed request per try, most useful
        first. A server that rejects a field answers 4xx; one that ignores it just sends no token ids / usage.
        The probe doubles as a warm-up and is not part of any level."""
        tries = [
            {"return_token_ids": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            {"return_token_ids": True, "stream_options": {"include_usage": True}},
            {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
            {"stream_options": {"include_usage": True}},
            {},
        ]
        notes = []
        for extras in tries:
            rec = RequestRecord(-1, prompt.id, prompt.workload)
            seen = {"token_ids": False, "usage_chunks": 0, "usage_final": False}
            try:
                await asyncio.wait_for(self._stream(self.body(prompt, 4, extras), rec, seen), timeout)
            except asyncio.TimeoutError:
                self.caps = Capabilities(probed=False, note=f"probe timed out after {timeout:g} s: no extensions "
                                                            "used, tokens counted from chunks")
                return self.caps
            if rec.http_status in (401, 403, 404):
                raise RuntimeError(f"{self.base}{self.path} answered HTTP {rec.http_status}: {rec.error} "
                                   "(check --api-key, --model and the URL)")
            if rec.error_class and rec.error_class.startswith("http_4"):
                notes.append(f"rejected {sorted(extras)} ({rec.http_status})")
                continue
            if not rec.ok:
                self.caps = Capabilities(probed=False, note=f"probe failed ({rec.error_class}: {rec.error}): no "
                                                            "extensions used, tokens counted from chunks")
                return self.caps
            self.caps = Capabilities(
                return_token_ids=seen["token_ids"],
                include_usage=seen["usage_final"],
                continuous_usage=seen["usage_chunks"] > 1 and "stream_options" in extras
                and extras["stream_options"].get("continuous_usage_stats", False),
                probed=True, note="; ".join(notes))
            return self.caps
        self.caps = Capabilities(probed=True, note="; ".join(notes) + ": tokens counted from chunks")
        return self.caps

    async def request(self, p: Prompt, rec: RequestRecord, max_tokens: int | None = None) -> RequestRecord:
        """Send `p` and fill `rec` (also when cancelled part-way: the caller marks what is still pending)."""
        rec.token_source = self.caps.token_source
        await self._stream(self.body(p, max_tokens), rec, None)
        return rec

    async def _stream(self, body: dict[str, Any], rec: RequestRecord, seen: dict | None) -> None:
        if not rec.token_source:
            rec.token_source = "token_ids" if body.get("return_token_ids") else (
                "usage_total" if body.get("stream_options") else "chunks")
        reader = _ChunkReader(rec, seen)
        t_send = time.perf_counter()
        try:
            async with self.http.stream("POST", self.path, json=body) as r:
                rec.headers_s = time.perf_counter() - t_send
                rec.http_status = r.status_code
                if r.status_code != 200:
                    rec.fail(f"http_{r.status_code}", _error_message((await r.aread()).decode(errors="replace")))
                    return
                done = False
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event: lines
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    reader.feed(data, time.perf_counter())
                rec.stream_end_s = time.perf_counter() - t_send
                if not done:
                    raise StreamError("the stream ended without [DONE]")
        except StreamError as e:
            rec.fail("stream", str(e))
        except httpx.TimeoutException as e:
            rec.fail("timeout", f"{type(e).__name__}: {e}")
        except httpx.HTTPError as e:  # connect / protocol / read / write errors, and anything else of the transport
            rec.fail("connection", f"{type(e).__name__}: {e}")
        finally:
            rec.text = "".join(reader.text)
            rec.token_ids = reader.ids if reader.ids or rec.token_source == "token_ids" else None
            if rec.token_source == "usage_total" and reader.final_usage is None and rec.status == "pending":
                rec.token_source = "chunks"
            finalize(rec, t_send, reader.chunk_times, reader.final_usage)
            if rec.status == "pending" and not _cancelled():
                rec.status = "ok"


def _error_message(raw: str) -> str:
    """The message of an OpenAI-style error body, or the body itself."""
    try:
        return json.loads(raw)["error"]["message"]
    except Exception:  # noqa: BLE001 - any non-OpenAI error body
        return raw


@dataclass
class _ChunkReader:
    """What one stream's SSE data chunks add up to: text, token ids, the arrival time and token count of every
    output-carrying chunk (counted by `rec.token_source`), and the last cumulative usage seen."""

    rec: RequestRecord
    seen: dict | None  # probe()'s notes on what the server sends, or None
    chunk_times: list[float] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    final_usage: int | None = None
    last_cum: int = 0

    def feed(self, data: str, now: float) -> None:
        """One `data:` payload (not `[DONE]`) that arrived at `now`."""
        try:
            obj = json.loads(data)
        except json.JSONDecodeError as e:
            raise StreamError(f"malformed SSE data ({e.msg}): {data[:80]!r}") from None
        if "error" in obj and not obj.get("choices"):
            err = obj["error"]
            raise StreamError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        cum = self._usage(obj)
        choices = obj.get("choices") or []
        if not choices:
            return
        ch = choices[0]
        piece = ((ch.get("delta") or {}).get("content") if "delta" in ch else ch.get("text")) or ""
        tids = ch.get("token_ids")
        if tids is None and isinstance(ch.get("delta"), dict):
            tids = ch["delta"].get("token_ids")
        if ch.get("finish_reason"):
            self.rec.finish_reason = ch["finish_reason"]
        if isinstance(tids, list):
            if self.seen is not None and tids:
                self.seen["token_ids"] = True
            self.ids += tids
        n = self._tokens(tids, cum, piece)
        self.text.append(piece)
        if n > 0 or (piece and self.rec.token_source == "token_ids"):
            # a chunk with text but no ids only happens if ids went missing: count it as one
            self.chunk_times.append(now)
            self.rec.chunk_tokens.append(max(n, 1))

    def _usage(self, obj: dict) -> int | None:
        """The chunk's cumulative completion tokens, if it carries usage (noted, with the prompt's tokens)."""
        cum = _usage_completion(obj)
        if cum is not None:
            self.final_usage = cum
            if self.seen is not None:
                self.seen["usage_chunks"] += 1
                self.seen["usage_final"] = True
            if isinstance(obj.get("usage"), dict) and isinstance(obj["usage"].get("prompt_tokens"), int):
                self.rec.prompt_tokens = obj["usage"]["prompt_tokens"]
        return cum

    def _tokens(self, tids: Any, cum: int | None, piece: str) -> int:
        """Output tokens this chunk carries, by the record's token source."""
        if self.rec.token_source == "token_ids":
            return len(tids) if isinstance(tids, list) else 0
        if self.rec.token_source == "continuous_usage":
            n = (cum - self.last_cum) if cum is not None else (1 if piece else 0)
            self.last_cum = cum if cum is not None else self.last_cum + n
            return n
        return 1 if piece else 0


def _cancelled() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
