"""What a connection may hold: time to send its request line and headers, time to send its body, and a place
among at most `max_connections`; the rest are refused at once instead of running the process out of file
descriptors.

uvicorn closes a connection idle between requests after `timeout_keep_alive`, but one that never finishes its
headers or its body it keeps forever: 1,320 slow or idle connections were all open a minute later, and at ~20,500
the server ran out of descriptors, /health timed out and every failed accept logged a traceback. `GuardedH11` is
uvicorn's h11 protocol with two deadlines and the cap; uvicorn's own `limit_concurrency` (a 503 for a request that
arrives over the cap) is set to the same number.
"""

from __future__ import annotations

import asyncio
import logging
import random
import resource
from dataclasses import dataclass, replace
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("verispec.server")

DEFAULT_KEEP_ALIVE = 5.0  # seconds an idle keep-alive connection stays open (uvicorn's default)
DEFAULT_HEADER_TIMEOUT = 10.0  # seconds from a connection (or the end of its last response) to a whole request head
DEADLINE_SPREAD = 0.2  # a deadline waits up to this share longer, at random (GuardedH11._arm)
DEFAULT_BODY_TIMEOUT = 30.0  # seconds from the head to the end of the body; the app answers 408 first (limits.py)
BODY_GRACE = 2.0  # the connection is closed this long after the app's own body deadline, if it still is open
FD_RESERVE = 256  # descriptors kept for the model files, threads' pipes and logs: connections get the rest
FD_SHARE = 0.9  # ... and at most this share of the limit

REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")
_REFUSAL_BODY = (b'{"error": {"message": "The server holds as many connections as it may (verispec serve '
                 b'--max-connections); retry in a moment.", "type": "server_error", "param": null, '
                 b'"code": "too_many_connections"}}')
TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
           b"content-length: %d\r\n\r\n%s")
_TIMEOUT_BODY = (b'{"error": {"message": "The request line and headers did not arrive in time (verispec serve '
                 b'--timeout-header).", "type": "invalid_request_error", "param": null, "code": "request_timeout"}}')


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT
    body_timeout: float = DEFAULT_BODY_TIMEOUT
    keep_alive: float = DEFAULT_KEEP_ALIVE
    max_connections: int | None = None  # None: default_max_connections()

    def __post_init__(self) -> None:
        for name in ("header_timeout", "body_timeout", "keep_alive"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {getattr(self, name)!r}")
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")

    def resolved(self) -> ConnectionLimits:
        """These limits with the connection cap filled in from the descriptor limit now in force."""
        return self if self.max_connections is not None else replace(self, max_connections=default_max_connections())


def raise_fd_limit() -> int:
    """Raise this process's soft limit on open files to its hard limit (as servers commonly do at start); returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return soft
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 16)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):  # not allowed here: keep the limit we have
        return soft
    return target


def default_max_connections(fd_limit: int | None = None) -> int:
    """Connections this process may hold and still open files: the descriptor limit less FD_RESERVE, at most
    FD_SHARE of it, at least 16."""
    if fd_limit is None:
        fd_limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if fd_limit == resource.RLIM_INFINITY:
        fd_limit = 1 << 16
    return max(16, min(fd_limit - FD_RESERVE, int(fd_limit * FD_SHARE)))


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol that refuses a connection over the cap with a 503, closes one whose request head
    has not arrived `header_timeout` seconds after it opened (or after its last response) with a 408, and closes
    one whose body has not arrived BODY_GRACE seconds after the app's own `body_timeout` (the app then sees a
    disconnect, an ordinary end). Its limits come from `guarded_protocol`."""

    limits: ConnectionLimits = ConnectionLimits(max_connections=1 << 16)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "head" or "body": what the armed deadline waits for

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:  # type: ignore[operator]
            log.warning("refused a connection: %d open (--max-connections)", len(self.connections))
            transport.write(REFUSAL % (len(_REFUSAL_BODY), _REFUSAL_BODY))
            transport.close()
            self.transport = None  # type: ignore[assignment]
            return
        super().connection_made(transport)
        self._arm("head", self.limits.header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self.transport is None:  # refused in connection_made: never counted
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.transport is None:
            return
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Arm the deadline for what the connection now waits for from the client; none while it waits on us."""
        state = self.conn.their_state
        if state is h11.IDLE and self.conn.our_state is h11.IDLE and self.timeout_keep_alive_task is None:
            if self._waiting_for != "head" and not self.transport.is_closing():
                self._arm("head", self.limits.header_timeout)
        elif state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._arm("body", self.limits.body_timeout + BODY_GRACE)
        elif self._waiting_for is not None:
            self._disarm()

    def _arm(self, what: str, seconds: float) -> None:
        """Wait `seconds` plus up to DEADLINE_SPREAD of them more (never less than promised), so that thousands of
        connections opened at once do not all expire in one turn of the event loop: their 408s and closes then
        spread over a second or two instead of holding every other request for a few hundred milliseconds."""
        self._disarm()
        self._waiting_for = what
        seconds *= 1 + DEADLINE_SPREAD * random.random()
        self._deadline = self.loop.call_later(seconds, self._expired, what)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._waiting_for = None, None

    def _expired(self, what: str) -> None:
        self._deadline, self._waiting_for = None, None
        if self.transport is None or self.transport.is_closing():
            return
        if what == "head" and self.conn.our_state is h11.IDLE:
            self.transport.write(TIMEOUT % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))
        log.info("closed a connection whose request %s did not arrive in time", what)
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedH11]:
    """GuardedH11 with `limits` (uvicorn builds one protocol object per connection from the class)."""
    return type("GuardedH11", (GuardedH11,), {"limits": limits.resolved()})


def uvicorn_options(limits: ConnectionLimits) -> dict[str, Any]:
    """The uvicorn.Config arguments that carry `limits`: the protocol, keep-alive, and uvicorn's concurrency cap
    one above ours (uvicorn counts the connection a request arrives on; GuardedH11 never lets the count past the
    cap, so uvicorn's 503 is left to requests in flight beyond it)."""
    limits = limits.resolved()
    return {"http": guarded_protocol(limits), "timeout_keep_alive": limits.keep_alive,
            "limit_concurrency": limits.max_connections + 1}  # type: ignore[operator]
