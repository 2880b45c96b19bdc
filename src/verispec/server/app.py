"""The OpenAI-compatible HTTP server: a FastAPI app over a `BackgroundEngine`, and the uvicorn runner.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `stream`, `n` choices and `logprobs`),
GET /v1/models, GET /v1/models/{id}, GET and HEAD /health, GET /metrics, GET /openapi.json, and with
`dev_endpoints` POST /reset_prefix_cache. Errors are OpenAI-shaped; one request's failure never stops the server; a
client that goes away aborts its request at once, freeing its batch slot and KV. Connections are bounded in number
and in the time they may take to send a request (server/connections.py); repeated log lines are rate-limited
(server/logfilter.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from verispec.server import logfilter
from verispec.server.connections import ConnectionLimits, raise_fd_limit, uvicorn_options
from verispec.server.generation import Generation
from verispec.server.lifecycle import AFTER_FAIL_S, DEFAULT_SHUTDOWN_TIMEOUT, Lifecycle
from verispec.server.limits import DEFAULT_BODY_TIMEOUT, default_max_request_bytes
from verispec.server.metrics import ServerMetrics
from verispec.server.openapi import install_openapi
from verispec.server.protocol import MAX_N, APIError, ServedModel, error_body, parse_chat, parse_completion

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


def _install_error_handlers(app: FastAPI) -> None:
    """Every error as OpenAI's body: ours with their status, FastAPI's validation as 400, unknown routes as 404 /
    405 naming the routes, anything else as a 500 that names the exception (logged with its traceback)."""

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


def create_app(llm: LLM, engine: BackgroundEngine, *, model_name: str | None = None, api_key: str | None = None,
               manage_engine: bool = True, max_request_bytes: int | None = None,
               shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT, dev_endpoints: bool = False,
               body_timeout: float = DEFAULT_BODY_TIMEOUT) -> FastAPI:
    """The app over `engine`, a BackgroundEngine of `llm`'s engine (`BackgroundEngine(llm.engine,
    llm.check_prompt_ids)`); `llm` parses prompts and decodes tokens. `manage_engine` starts / shuts the engine down
    with the app. Bodies over `max_request_bytes` (default: limits.default_max_request_bytes, 1-4 MiB by the context)
    get a 413, bodies not arrived `body_timeout` seconds after their headers a 408; on shutdown (served by
    `make_server`) running requests get `shutdown_timeout` seconds to finish (server/lifecycle.py). `dev_endpoints` adds POST /reset_prefix_cache (vLLM's dev-mode route)."""
    if max_request_bytes is None:
        max_request_bytes = default_max_request_bytes(llm.max_model_len)
    if max_request_bytes < 1:
        raise ValueError(f"max_request_bytes must be >= 1, got {max_request_bytes}")
    if not body_timeout > 0:
        raise ValueError(f"body_timeout must be a number of seconds > 0, got {body_timeout!r}")
    served = served_model(llm, model_name)
    lifecycle = Lifecycle(shutdown_timeout)
    metrics = ServerMetrics(engine.snapshot, {**llm.path_choice.as_dict(), "device": llm.device,
                                              "batch_invariant": llm.model.batch_invariant,
                                              "kv_cache_dtype": llm.kv_cache_dtype,
                                              "speculative_method": llm.spec.method,
                                              "drafter_weights": llm.drafters.weight_format or "none"})

    app = FastAPI(title="verispec", lifespan=_lifespan(engine, manage_engine), docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    install_openapi(app, llm.max_model_len, llm.model.cfg.vocab_size, MAX_N)  # request / response schemas
    app.state.llm, app.state.engine, app.state.metrics, app.state.served = llm, engine, metrics, served
    app.state.lifecycle, app.state.body_timeout = lifecycle, body_timeout
    if api_key:
        app.add_middleware(BearerAuth, api_key=api_key)
    _install_error_handlers(app)
    _install_routes(app, Generation(llm, engine, served, metrics, lifecycle, max_request_bytes, body_timeout))
    if dev_endpoints:
        _install_dev_routes(app)
    return app


def _lifespan(engine: BackgroundEngine, manage_engine: bool) -> Callable[[FastAPI], Any]:
    """Starts the engine with the app and shuts it down after (when the app manages it)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            engine.start()
        try:
            yield
        finally:
            if manage_engine:
                await asyncio.to_thread(engine.shutdown)
    return lifespan


def _install_routes(app: FastAPI, generate: Generation) -> None:
    """The OpenAI routes, /health and /metrics, over the app's state."""
    served, engine, lifecycle, metrics = app.state.served, app.state.engine, app.state.lifecycle, app.state.metrics

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

    @app.api_route("/health", methods=["GET", "HEAD"])
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


def _install_dev_routes(app: FastAPI, timeout_s: float = 60.0) -> None:
    """POST /reset_prefix_cache, as vLLM serves it in dev mode: 200 once the cache has forgotten its blocks, 409
    while requests run (nothing changed), 503 when the engine is not running."""
    engine = app.state.engine

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        if not engine.is_alive():
            raise APIError(503, "The engine is not running.", type="server_error")
        try:
            done = await asyncio.wait_for(asyncio.wrap_future(engine.reset_prefix_cache()), timeout_s)
        except asyncio.TimeoutError:
            raise APIError(503, f"The engine did not take the reset within {timeout_s:g} s.",
                           type="server_error") from None
        if not done:
            raise APIError(409, "Requests are running; the prefix cache can be reset once none is in flight.",
                           code="conflict")
        return Response(status_code=200)


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
                on_ready: Callable[[str], None] | None = None, shutdown_timeout: float | None = None,
                connections: ConnectionLimits | None = None) -> uvicorn.Server:
    """A uvicorn server for `app`; `.run()` serves until Ctrl-C / SIGTERM (or `.should_exit = True`), then shuts
    down gracefully: running requests get `shutdown_timeout` seconds (default: create_app's) to finish.
    `connections` bounds the connections (default: ConnectionLimits(), its body timeout the app's); repeated log
    lines are rate-limited from here on."""
    served: ServedModel = app.state.served
    if shutdown_timeout is not None:
        app.state.lifecycle.set_timeout(shutdown_timeout)

    def announce(url: str) -> None:
        print(f"verispec: serving {served.id} at {url}/v1 (OpenAI-compatible; also {url}/metrics, {url}/health)",
              flush=True)

    if connections is None:
        connections = ConnectionLimits(body_timeout=app.state.body_timeout)
    # the drain has already waited for the requests; this only bounds sending their last bytes
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=AFTER_FAIL_S,
                            **uvicorn_options(connections))
    logfilter.install()  # after uvicorn.Config has set up its loggers (their filters stay when that runs again)
    return _Server(config, on_ready or announce, app)


def run_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, *, log_level: str = "info",
               shutdown_timeout: float | None = None, connections: ConnectionLimits | None = None) -> None:
    """Serve `app` until interrupted, with the open-files limit raised to its hard limit first (room for
    connections); the engine shuts down with it."""
    raise_fd_limit()
    make_server(app, host, port, log_level=log_level, shutdown_timeout=shutdown_timeout,
                connections=connections).run()
