"""The two generation routes' work: read and parse a body off the event loop, submit one engine request per choice,
and answer whole (JSON) or streamed (SSE), with every request's end reported to the lifecycle and the metrics.

`Run` is one submitted engine request as the server sees it (its events, its metrics record, a watcher that aborts it
when the client goes away); `Generation` serves a parsed request with its runs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from verispec.server.fanout import choice_params, drain, interleave
from verispec.server.lifecycle import Lifecycle
from verispec.server.limits import (DEFAULT_BODY_TIMEOUT, ClientGone, check_content_type, check_json,
                                    check_prompt_bytes, check_prompt_tokens, prompt_byte_limit, read_body)
from verispec.server.logprobs import LogprobsFormatter, token_text
from verispec.server.metrics import RequestRecord, ServerMetrics
from verispec.server.protocol import APIError, ParsedRequest, ServedModel, bad_request, parse_json
from verispec.server.responses import SSE_DONE, IncrementalText, ResponseBuilder, sse

if TYPE_CHECKING:
    from verispec.api import LLM
    from verispec.engine.background import BackgroundEngine
    from verispec.sampling import SamplingParams

log = logging.getLogger("verispec.server")

Parse = Callable[..., ParsedRequest]


class Run:
    """One submitted request: its events, metrics record and client-disconnect watcher."""

    def __init__(self, request: Request, stream: Any, record: RequestRecord) -> None:
        self.stream, self.record = stream, record
        self.ids: list[int] = []
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.stop_reason: str | None = None  # the stop string that ended the output
        self.stop_text: str | None = None  # the output text cut at it (decoding `ids` runs past the cut)
        self.logprobs: list[Any] = []  # per token of `ids`, when the request asked for logprobs
        self.ended = False
        self._watcher = asyncio.create_task(self._abort_on_disconnect(request))

    async def _abort_on_disconnect(self, request: Request) -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        if not self.ended:
            log.info("client went away: aborting %s", self.stream.request_id)
            self.stream.abort()

    async def events(self) -> AsyncIterator[Any]:
        try:
            async for ev in self.stream:
                self.ids.extend(ev.token_ids)
                self.logprobs.extend(ev.logprobs or ())
                self.record.on_tokens(len(ev.token_ids))
                if ev.error or ev.finish_reason == "error":
                    self.error = ev.error or "the engine failed on this request"
                elif ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
                    self.stop_reason, self.stop_text = ev.stop_reason, ev.stop_text
                if self.error or self.finish_reason:
                    self.ended = True
                    self.record.finish(self.finish_reason, error=self.error is not None, queue_s=ev.queue_s)
                yield ev
                if self.ended:
                    return
        except Exception as e:  # noqa: BLE001 - the stream itself failed: this request ends with an error
            log.exception("stream of %s failed", self.stream.request_id)
            self.error = f"{type(e).__name__}: {e}"
            self.ended = True
            self.record.finish(None, error=True)

    def close(self) -> None:
        self._watcher.cancel()
        if not self.ended:  # the client left, or the response was cancelled: free the slot now
            self.ended = True
            self.stream.abort()
            self.record.finish("abort")


def close(runs: list[Run]) -> None:
    for run in runs:
        run.close()


def whole_choice(builder: ResponseBuilder, run: Run, index: int, decode: Callable[[list[int]], str],
                 token_str: Callable[[int], str]) -> dict[str, Any]:
    """Choice `index` of a whole (non-streamed) response: text (cut at a stop string), logprobs if asked."""
    text = decode(run.ids) if run.stop_text is None else run.stop_text
    lp = None
    if builder.req.params.logprobs is not None:
        lp = LogprobsFormatter(builder.req.kind, token_str).format(run.logprobs)
    return builder.choice(text, run.ids, run.finish_reason, run.stop_reason, index, lp)


class EventStream(StreamingResponse):
    """An SSE response that calls `on_end` once it is over: sent whole, failed, or cancelled before it started."""

    def __init__(self, events: AsyncIterator[str], on_end: Callable[[], Any]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_end = on_end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


class Generation:
    """POST /v1/completions and /v1/chat/completions over `engine`: `await gen(request, parse_completion)`."""

    def __init__(self, llm: LLM, engine: BackgroundEngine, served: ServedModel, metrics: ServerMetrics,
                 lifecycle: Lifecycle, max_request_bytes: int, body_timeout: float = DEFAULT_BODY_TIMEOUT) -> None:
        self.llm, self.engine, self.served, self.metrics = llm, engine, served, metrics
        self.lifecycle, self.max_request_bytes, self.body_timeout = lifecycle, max_request_bytes, body_timeout
        self.token_str = token_text(llm.tokenizer)
        self.prompt_bytes = prompt_byte_limit(llm)

    def submit(self, req: ParsedRequest, params: SamplingParams) -> Any:
        from verispec.engine.background import EngineOverloaded, RequestTooLong

        try:
            return self.engine.submit(req.prompt_ids, params)
        except EngineOverloaded as e:
            retry = max(1, math.ceil(e.retry_after))
            raise APIError(503, f"The server is overloaded: {e}. Retry after {retry} s.", type="server_error",
                           code="server_overloaded", headers={"Retry-After": str(retry)}) from None
        except RequestTooLong as e:
            raise bad_request(str(e), "max_tokens", "context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    def parse_request(self, raw: bytes, parse: Parse) -> tuple[ParsedRequest, list[SamplingParams]]:
        """JSON, shape checks, tokenising and each choice's parameters: on a worker thread, so a big request never
        stalls the event loop."""
        body = parse_json(raw)
        check_json(body)
        check_prompt_bytes(body, self.prompt_bytes)
        check_prompt_tokens(body, self.llm)
        req = parse(body, self.llm, self.served)
        return req, [choice_params(req.params, i) for i in range(req.n)]

    async def __call__(self, request: Request, parse: Parse) -> Response:
        arrival = time.perf_counter()
        self.lifecycle.admit()
        check_content_type(request)
        self.lifecycle.enter()
        streaming = False  # once handed over, the EventStream tells the lifecycle it ended
        try:
            try:
                raw = await read_body(request, self.max_request_bytes, self.body_timeout, self.lifecycle.stopping(),
                                      self.lifecycle.refuse_unread)
            except ClientGone:  # hung up while sending: nothing to answer, nothing went wrong
                log.info("client went away while sending its request body")
                return Response(status_code=400)
            req, params = await asyncio.to_thread(self.parse_request, raw, parse)
            self.lifecycle.admit()
            runs = self.start_runs(request, req, params, arrival)
            builder = ResponseBuilder(req, self.served.id)
            if req.stream:
                streaming = True
                return EventStream(self.sse_events(runs, builder), lambda: (close(runs), self.lifecycle.exit()))
            try:
                await drain(runs)
            finally:
                close(runs)
            failed = next((r for r in runs if r.error), None)
            if failed is not None:
                raise self.lifecycle.stopped(failed.error)  # type: ignore[arg-type]
            choices = [whole_choice(builder, run, i, self.llm.decode, self.token_str) for i, run in enumerate(runs)]
            return JSONResponse(builder.full_response(choices, sum(len(r.ids) for r in runs)))
        finally:
            if not streaming:
                self.lifecycle.exit()

    def start_runs(self, request: Request, req: ParsedRequest, params: list[SamplingParams],
                   arrival: float) -> list[Run]:
        """One engine request per choice (`n`, with `params[i]`); if one cannot be submitted, those already are
        aborted."""
        runs: list[Run] = []
        try:
            for p in params:
                runs.append(Run(request, self.submit(req, p), self.metrics.track(arrival, len(req.prompt_ids))))
        except BaseException:
            close(runs)
            raise
        return runs

    async def sse_events(self, runs: list[Run], builder: ResponseBuilder) -> AsyncIterator[str]:
        """The choices' chunks as their tokens come (each tagged with its index), usage, one [DONE]."""
        p, kind = builder.req.params, builder.req.kind
        texts = [IncrementalText(self.llm.decode, () if p.include_stop_str_in_output else p.stop) for _ in runs]
        fmts = [LogprobsFormatter(kind, self.token_str) if p.logprobs is not None else None for _ in runs]
        try:
            for i in range(len(runs)):
                first = builder.first_chunk(i)
                if first:
                    yield first
            async with aclosing(interleave(runs)) as events:  # closed at once on an error's break
                async for i, ev in events:
                    run = runs[i]
                    if run.error:
                        break
                    delta = texts[i].update(run.ids, final=run.finish_reason is not None, text=run.stop_text)
                    fmt = fmts[i]
                    lp = fmt.format(ev.logprobs or []) if fmt is not None and ev.token_ids else None
                    show = (builder.req.return_token_ids or lp) and ev.token_ids
                    if delta or run.finish_reason is not None or show:
                        yield builder.delta_chunk(delta, list(ev.token_ids), run.finish_reason, run.stop_reason, i, lp)
            failed = next((r for r in runs if r.error), None)
            if failed is not None:
                yield sse(self.lifecycle.stopped(failed.error).body())  # type: ignore[arg-type]
            else:
                tail = builder.usage_chunk(sum(len(r.ids) for r in runs))
                if tail:
                    yield tail
            yield SSE_DONE
        finally:
            close(runs)
