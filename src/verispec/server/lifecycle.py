"""Graceful shutdown: stop admitting, let running requests finish, end the rest with a proper error.

uvicorn's own shutdown (on SIGTERM, Ctrl-C or `should_exit`) closes the listening socket, waits
`timeout_graceful_shutdown` for open connections, then cancels what still runs: streams cut mid-body, plain-text
500s. `Lifecycle.drain` runs first (the server's `shutdown`, app._Server), while the socket still accepts:
  1. new generation requests get 503 `server_shutting_down` with Retry-After, /health 503;
  2. running requests get up to `shutdown_timeout` seconds to finish normally;
  3. what is left is failed in the engine, so each handler answers its OpenAI error body (non-stream) or its final
     SSE error event and `data: [DONE]` (stream), for up to AFTER_FAIL_S seconds.
Then uvicorn's shutdown runs with nothing left to cancel; after it new connections are refused.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Callable

from verispec.server.protocol import APIError

if TYPE_CHECKING:
    from verispec.engine.background import BackgroundEngine

log = logging.getLogger("verispec.server")

DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds running requests get to finish once shutdown begins
AFTER_FAIL_S = 5.0  # then the handlers' time to send the error bodies of the requests failed for it
RETRY_AFTER_S = 5


class Lifecycle:
    """Whether the server still admits requests, and how many generation requests are between their arrival and
    the last byte of their response."""

    def __init__(self, shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        self.set_timeout(shutdown_timeout)
        self.draining = False
        self.active = 0
        self._stopping: asyncio.Future | None = None  # done once draining: ends the waits for request bodies

    def set_timeout(self, shutdown_timeout: float) -> None:
        if not shutdown_timeout >= 0:
            raise ValueError(f"the shutdown timeout must be a number of seconds >= 0, got {shutdown_timeout!r}")
        self.shutdown_timeout = float(shutdown_timeout)

    def admit(self) -> None:
        """503 with Retry-After once shutdown has begun."""
        if self.draining:
            raise APIError(503, "The server is shutting down and takes no new requests; retry in a moment (on "
                                "another replica, or once it is back).", type="server_error",
                           code="server_shutting_down", headers={"Retry-After": str(RETRY_AFTER_S)})

    def stopping(self) -> asyncio.Future:
        """A future (of the running loop) that is done once shutdown has begun."""
        if self._stopping is None:
            self._stopping = asyncio.get_running_loop().create_future()
            if self.draining:
                self._stopping.set_result(None)
        return self._stopping

    def refuse_unread(self) -> APIError:
        """The answer to a request whose body was still arriving when shutdown began: 503, and the connection
        closes (a half-sent body would otherwise hold the exit until uvicorn cancels it with a plain-text 500)."""
        return APIError(503, "The server is shutting down; this request's body had not arrived yet. Retry in a "
                             "moment.", type="server_error", code="server_shutting_down",
                        headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})

    def enter(self) -> None:
        self.active += 1

    def exit(self) -> None:
        assert self.active > 0, "a request left the server twice"
        self.active -= 1

    def stopped(self, error: str) -> APIError:
        """The error of a request the engine ended: 503 while shutting down (the request was cut off), else 500."""
        if self.draining:
            return APIError(503, f"Generation stopped: {error}", type="server_error", code="server_shutting_down",
                            headers={"Retry-After": str(RETRY_AFTER_S)})
        return APIError(500, f"Generation failed: {error}", type="server_error", code="engine_error")

    async def drain(self, engine: BackgroundEngine, force_exit: Callable[[], bool] = lambda: False) -> None:
        """Steps 1-3 above; returns early when `force_exit()` turns true (a second Ctrl-C)."""
        self.draining = True
        if self._stopping is not None and not self._stopping.done():
            self._stopping.set_result(None)
        if self.active:
            log.info("shutting down: waiting up to %g s for %d running request(s)", self.shutdown_timeout,
                     self.active)
        if await self._wait(self.shutdown_timeout, force_exit):
            return
        log.warning("shutting down: %d request(s) still running after %g s (--shutdown-timeout): ending them with "
                    "an error", self.active, self.shutdown_timeout)
        engine.fail_in_flight(f"the server is shutting down and this request did not finish within its "
                              f"{self.shutdown_timeout:g} s shutdown timeout")
        if not await self._wait(AFTER_FAIL_S, force_exit):
            log.warning("shutting down: %d request(s) did not end; closing their connections", self.active)

    async def _wait(self, seconds: float, force_exit: Callable[[], bool]) -> bool:
        """Wait until no request is active (True), `seconds` pass (False) or force_exit() (True)."""
        deadline = time.monotonic() + seconds
        while self.active and not force_exit():
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True
