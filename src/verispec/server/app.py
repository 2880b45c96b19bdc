"""The OpenAI-compatible HTTP server: a FastAPI app over a `BackgroundEngine`, and the uvicorn runner.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`), GET /v1/models, GET /health,
GET /metrics. Errors are OpenAI-shaped; one request's failure never stops the server; a client that goes away
aborts its request at once, freeing its batch slot and KV.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.server.metrics import RequestRecord, ServerMetrics
from verispec.server.protocol import (SSE_DONE, APIError, IncrementalText, ParsedRequest, ResponseBuilder,
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
                self.record.on_tokens(len(ev.token_ids))
                if ev.error or ev.finish_reason == "error":
                    self.error = ev.error or "the engine failed on this request"
                elif ev.finish_reason is not None:
                    self.finish_reason = ev.finish_reason
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


def create_app(llm: LLM, engine: BackgroundEngine, *, model_name: str | None = None, api_key: str | None = None,
               manage_engine: bool = True) -> FastAPI:
    """The app over `engine`, a BackgroundEngine of `llm`'s engine (`BackgroundEngine(llm.engine,
    llm.check_prompt_ids)`); `llm` parses prompts and decodes tokens. `manage_engine` starts / shuts the engine down
    with the app."""
    from verispec.engine.background import EngineOverloaded, RequestTooLong

    served = served_model(llm, model_name)
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

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.llm, app.state.engine, app.state.metrics, app.state.served = llm, engine, metrics, served
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
               "/v1/models, /health, /metrics." if exc.status_code in (404, 405) else str(exc.detail))
        return JSONResponse(error_body(msg, code="not_found" if exc.status_code == 404 else None),
                            exc.status_code, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"Internal server error: {type(exc).__name__}: {exc}", "server_error"), 500)

    def submit(req: ParsedRequest) -> Any:
        try:
            return engine.submit(req.prompt_ids, req.params)
        except EngineOverloaded as e:
            retry = max(1, math.ceil(e.retry_after))
            raise APIError(503, f"The server is overloaded: {e}. Retry after {retry} s.", type="server_error",
                           code="server_overloaded", headers={"Retry-After": str(retry)}) from None
        except RequestTooLong as e:
            raise bad_request(str(e), "max_tokens", "context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(str(e)) from None

    async def generate(request: Request, parse: Callable[..., ParsedRequest]) -> Response:
        arrival = time.perf_counter()
        req = parse(parse_json(await request.body()), llm, served)
        stream = submit(req)
        run = Run(request, stream, metrics.track(arrival, len(req.prompt_ids)))
        builder = ResponseBuilder(req, served.id)
        if req.stream:
            return StreamingResponse(sse_events(run, builder), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            async for _ in run.events():
                pass
        finally:
            run.close()
        if run.error:
            raise APIError(500, f"Generation failed: {run.error}", type="server_error", code="engine_error")
        return JSONResponse(builder.response(llm.decode(run.ids), run.ids, run.finish_reason))

    async def sse_events(run: Run, builder: ResponseBuilder) -> AsyncIterator[str]:
        text = IncrementalText(llm.decode)
        try:
            first = builder.first_chunk()
            if first:
                yield first
            async for ev in run.events():
                if run.error:
                    break
                delta = text.update(run.ids, final=run.finish_reason is not None)
                if delta or run.finish_reason is not None or (builder.req.return_token_ids and ev.token_ids):
                    yield builder.delta_chunk(delta, list(ev.token_ids), run.finish_reason)
            if run.error:
                yield sse(error_body(f"Generation failed: {run.error}", "server_error", code="engine_error"))
            else:
                tail = builder.usage_chunk(len(run.ids))
                if tail:
                    yield tail
            yield SSE_DONE
        finally:
            run.close()

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
        if not engine.is_alive():
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return app


class _Server(uvicorn.Server):
    """uvicorn's server, announcing the URL once the socket is bound (port 0 shows the port it got)."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[str], None]) -> None:
        super().__init__(config)
        self.on_ready = on_ready

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.should_exit or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        self.on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
                on_ready: Callable[[str], None] | None = None) -> uvicorn.Server:
    """A uvicorn server for `app`; `.run()` serves until Ctrl-C / SIGTERM (or `.should_exit = True`)."""
    served: ServedModel = app.state.served

    def announce(url: str) -> None:
        print(f"verispec: serving {served.id} at {url}/v1 (OpenAI-compatible; also {url}/metrics, {url}/health)",
              flush=True)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    return _Server(config, on_ready or announce)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info") -> None:
    """Serve `app` until interrupted; the engine shuts down with it."""
    make_server(app, host, port, log_level=log_level).run()
