"""The OpenAI-compatible HTTP server: a FastAPI app over a `BackgroundEngine`, and the uvicorn runner.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`, `n` choices and `logprobs`),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics, GET /openapi.json. Errors are OpenAI-shaped; one
request's failure never stops the server; a client that goes away aborts its request at once, freeing its batch
slot and KV.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.server.lifecycle import AFTER_FAIL_S, DEFAULT_SHUTDOWN_TIMEOUT, Lifecycle
from verispec.server.limits import (DEFAULT_MAX_REQUEST_BYTES, check_json, check_prompt_bytes, prompt_byte_limit,
                                    read_body)
from verispec.server.fanout import choice_params, drain, interleave
from verispec.server.logprobs import LogprobsFormatter, token_text
from verispec.server.metrics import RequestRecord, ServerMetrics
from verispec.server.openapi import install_openapi
from verispec.server.protocol import (MAX_N, SSE_DONE, APIError, IncrementalText, ParsedRequest, ResponseBuilder,
                                      ServedModel, bad_request, error_body, parse_chat, parse_completion,
                                      parse_json, sse)

if TYPE_CHECKING:
    from verispec.api import LLM
    from verispec.engine.background import BackgroundEngine

log = logging.getLogger("verispec.server")
OPEN_PATHS = frozenset({"/health"})


def served_model(llm: LLM, name: str | None = None) -> ServedModel:
    """The id shown by /v1/models (`name`, else what --model said) and the other names that reach it."""
    from verispec.models import hub

    spec = llm.resolved.name
    aliases = {spec.lower(), Path(spec).name.lower(), llm.resolved.directory.name.lower()}
    if llm.resolved.gguf is not None:
        aliases |= {llm.resolved.gguf.name.lower(), llm.resolved.gguf.stem.lower()}
    known = hub.lookup_known(spec)
    if known is not None:
        aliases |= {known.name.lower()} | {a for a, n in hub.ALIASES.items() if n == known.name}
    return ServedModel(name or spec, frozenset(aliases - {""}), llm.max_model_len, int(time.time()))


class BearerAuth:
    """Pure ASGI middleware: every path but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = auth.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                what = "Missing" if not auth else "Incorrect"
                body = error_body(f"{what} API key. Send the server's --api-key as 'Authorization: Bearer KEY' "
                                  "(the OpenAI client's api_key).", code="invalid_api_key")
                await JSONResponse(body, 401, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


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
                    self.record.finish(self.finish_reason, error=self.error is not None)
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


def create_app(llm: LLM, engine: BackgroundEngine, *, model_name: str | None = None, api_key: str | None = None,
               manage_engine: bool = True, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> FastAPI:
    """The app over `engine`, a BackgroundEngine of `llm`'s engine (`BackgroundEngine(llm.engine,
    llm.check_prompt_ids)`); `llm` parses prompts and decodes tokens. `manage_engine` starts / shuts the engine down
    with the app. Bodies over `max_request_bytes` get a 413; on shutdown (served by `make_server`) running requests
    get `shutdown_timeout` seconds to finish (server/lifecycle.py)."""
    from verispec.engine.background import EngineOverloaded, RequestTooLong

    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    served = served_model(llm, model_name)
    token_str = token_text(llm.tokenizer)
    lifecycle, prompt_bytes = Lifecycle(shutdown_timeout), prompt_byte_limit(llm)
    metrics = ServerMetrics(engine.snapshot, {**llm.path_choice.as_dict(), "device": llm.device,
                                              "batch_invariant": llm.model.batch_invariant})

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, llm.max_model_len, llm.model.cfg.vocab_size, MAX_N)  # request / response schemas
    app.state.llm, app.state.engine, app.state.metrics, app.state.served = llm, engine, metrics, served
    app.state.lifecycle = lifecycle
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), exc.status, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return JSONResponse(error_body(f"Invalid request: {err.get('msg', exc)}", param=param), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        msg = (f"Unknown route {request.method} {request.url.path}; see /v1/completions, /v1/chat/completions, "
               "/v1/models, /health, /metrics, /openapi.json." if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(error_body(msg, code="not_found" if exc.status_code == 404 else None),
                            exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"), 500)

    def submit(req: ParsedRequest, index: int = 0) -> Any:
        try:
            return engine.submit(req.prompt_ids, choice_params(req.params, index))
        except EngineOverloaded as e:
            retry = max(1, math.ceil(e.retry_after))
            raise APIError(503, f"The server is overloaded: {e}. Retry after {retry} s.", type="server_error",
                           code="server_overloaded", headers={"Retry-After": str(retry)}) from None
        except RequestTooLong as e:
            raise bad_request(str(e), "max_tokens", "context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    def parse_request(raw: bytes, parse: Callable[..., ParsedRequest]) -> ParsedRequest:
        """JSON, shape checks and tokenising: on a worker thread, so a big prompt never stalls the event loop."""
        body = parse_json(raw)
        check_json(body)
        check_prompt_bytes(body, prompt_bytes)
        return parse(body, llm, served)

    async def generate(request: Request, parse: Callable[..., ParsedRequest]) -> Response:
        arrival = time.perf_counter()
        lifecycle.admit()
        lifecycle.enter()
        streaming = False  # once handed over, the EventStream tells the lifecycle it ended
        try:
            raw = await read_body(request, max_request_bytes)
            req = await asyncio.to_thread(parse_request, raw, parse)
            lifecycle.admit()
            runs = start_runs(request, req, arrival)
            builder = ResponseBuilder(req, served.id)
            if req.stream:
                streaming = True
                return EventStream(sse_events(runs, builder), lambda: (close(runs), lifecycle.exit()))
            try:
                await drain(runs)
            finally:
                close(runs)
            failed = next((r for r in runs if r.error), None)
            if failed is not None:
                raise lifecycle.stopped(failed.error)  # type: ignore[arg-type]
            choices = [whole_choice(builder, run, i, llm.decode, token_str) for i, run in enumerate(runs)]
            return JSONResponse(builder.full_response(choices, sum(len(r.ids) for r in runs)))
        finally:
            if not streaming:
                lifecycle.exit()

    def start_runs(request: Request, req: ParsedRequest, arrival: float) -> list[Run]:
        """One engine request per choice (`n`); if one cannot be submitted, those already are aborted."""
        runs: list[Run] = []
        try:
            for i in range(req.n):
                runs.append(Run(request, submit(req, i), metrics.track(arrival, len(req.prompt_ids))))
        except BaseException:
            close(runs)
            raise
        return runs

    async def sse_events(runs: list[Run], builder: ResponseBuilder) -> AsyncIterator[str]:
        """The choices' chunks as their tokens come (each tagged with its index), usage, one [DONE]."""
        p, kind = builder.req.params, builder.req.kind
        texts = [IncrementalText(llm.decode, () if p.include_stop_str_in_output else p.stop) for _ in runs]
        fmts = [LogprobsFormatter(kind, token_str) if p.logprobs is not None else None for _ in runs]
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
                yield sse(lifecycle.stopped(failed.error).body())  # type: ignore[arg-type]
            else:
                tail = builder.usage_chunk(sum(len(r.ids) for r in runs))
                if tail:
                    yield tail
            yield SSE_DONE
        finally:
            close(runs)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, parse_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await generate(request, parse_chat)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [served.card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        served.check(model_id)
        return served.card()

    @app.get("/health")
    async def health() -> Response:
        if lifecycle.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if not engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, announcing the URL once the socket is bound (port 0 shows the port it got), and draining
    the app's requests before uvicorn's own shutdown (server/lifecycle.py)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None], app: FastAPI) -> None:
        super().__init__(config)
        self.on_ready, self.app = on_ready, app

    async def shutdown(self, sockets: Any = None) -> None:
        await self.app.state.lifecycle.drain(self.app.state.engine, lambda: self.force_exit)
        await super().shutdown(sockets)

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                on_ready: Callable[[str], None] | None = None, shutdown_timeout: float | None = None) -> uvicorn.Server:
    """A uvicorn server for `app`; `.run()` serves until Ctrl-C / SIGTERM (or `.should_exit = True`), then shuts
    down gracefully: running requests get `shutdown_timeout` seconds (default: create_app's) to finish."""
    served: ServedModel = app.state.served
    if shutdown_timeout is not None:
        app.state.lifecycle.set_timeout(shutdown_timeout)

    def announce(url: str) -> None:
        print(f"verispec: serving {served.id} at {url}/v1 (OpenAI-compatible; also {url}/metrics, {url}/health)",
              flush=True)

    # the drain has already waited for the requests; this only bounds sending their last bytes
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=AFTER_FAIL_S)
    return _Server(config, on_ready or announce, app)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
               shutdown_timeout: float | None = None) -> None:
    """Serve `app` until interrupted; the engine shuts down with it."""
    make_server(app, host, port, log_level=log_level, shutdown_timeout=shutdown_timeout).run()
