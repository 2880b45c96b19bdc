"""The engine on a worker thread, for the server: submit from the event loop, stream tokens back.

The worker owns the Engine: only it steps, adds and aborts. Other threads hand it work through a locked
inbox, and get tokens back as TokenEvents on an asyncio queue (or a plain queue when there is no loop).
An exception out of a step (the shared forward) finishes every request then in flight with an error event; the worker
goes on (a failure verifying one request ends only that one, inside `Engine.step`).

Built from an `Engine` (configured beforehand: batch size, scheduler) and a validator of prompt token ids, called
on the submitting thread (e.g. `LLM.check_prompt_ids`): `BackgroundEngine(llm.engine, llm.check_prompt_ids)`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator, Callable, Iterator, Sequence

from verispec.engine.core import Engine, RequestTooLong
from verispec.sampling.logprobs import TokenLogprobs
from verispec.sampling import SamplingParams
from verispec.kernels.threads import release_openmp_threads
from verispec.state.request import Request

log = logging.getLogger(__name__)

__all__ = ["BackgroundEngine", "EngineOverloaded", "EngineSnapshot", "PromptValidator", "RequestStream",
           "RequestTooLong", "TokenEvent"]

# raises ValueError for prompt token ids the model cannot take; must be safe to call from any thread
PromptValidator = Callable[[Sequence[int]], None]


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; try again after `retry_after` seconds."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]  # new tokens of this step (several when drafts were accepted)
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" on the last event
    error: str | None = None
    stop_reason: str | None = None  # on the last event: the stop string that ended the output
    stop_text: str | None = None  # with it: the output text cut there (decoding the tokens runs past the cut)
    logprobs: list[TokenLogprobs] | None = None  # of token_ids, when the request asked (sampling/logprobs.py)
    queue_s: float | None = None  # on the last event: seconds from submission to admission (None: never admitted)


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int
    num_waiting: int
    kv_usage: float  # KV blocks in use / all blocks
    kv_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int] = field(default_factory=list)
    num_finished: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of them, found cached (not prefilled)
    num_preemptions: int = 0  # requests preempted (KV blocks ran out), to be recomputed
    engine_steps: int = 0  # steps that ran a forward
    forward_tokens: int = 0  # rows fed to those forwards (decode blocks with their drafts, prefill chunks)
    step_seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds, summed (engine/counters.py)


class RequestStream:
    """Tokens of one request as they are produced. Iterate with `async for` (or `events()` without a loop)."""

    def __init__(self, req: Request, engine: "BackgroundEngine") -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = req.prompt_ids
        self._req, self._engine = req, engine
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            self._aq: asyncio.Queue[TokenEvent] | None = asyncio.Queue()
        except RuntimeError:
            self._loop, self._aq = None, None
        self._q: queue.Queue[TokenEvent] = queue.Queue()
        self.finished = False

    @property
    def output_ids(self) -> list[int]:
        return list(self._req.output_ids)

    @property
    def stats(self) -> dict[str, Any]:
        s = self._req.stats.as_dict()
        s.update(self._req.spec.as_dict())
        return s

    def _push(self, ev: TokenEvent) -> None:  # called on the worker thread
        if self._loop is not None and self._aq is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # the loop is closed: nobody listens any more
                pass
        else:
            self._q.put(ev)

    async def __aiter__(self) -> AsyncIterator[TokenEvent]:
        assert self._aq is not None, "async iteration needs submit() to be called from the event loop"
        while not self.finished:
            ev = await self._aq.get()
            self.finished = ev.finish_reason is not None
            yield ev

    def events(self, timeout: float | None = None) -> Iterator[TokenEvent]:
        assert self._aq is None, "this stream was submitted from an event loop: use `async for`"
        while not self.finished:
            ev = self._q.get(timeout=timeout)
            self.finished = ev.finish_reason is not None
            yield ev

    def abort(self) -> None:
        if not self.finished:
            self._engine.abort(self.request_id)


class BackgroundEngine:
    def __init__(self, engine: Engine, validate: PromptValidator, max_waiting: int = 256,
                 idle_wait_s: float = 0.02) -> None:
        self.engine, self.validate = engine, validate
        self.max_waiting = max_waiting
        self._idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._inbox: list[tuple[Request, RequestStream]] = []
        self._aborts: list[str] = []
        self._fail: str | None = None  # fail_in_flight's message, until the worker has acted on it
        self._resets: list[Future] = []  # reset_prefix_cache's answers, until the worker has tried
        self._streams: dict[str, RequestStream] = {}
        self._stop = False
        self._thread: threading.Thread | None = None
        self._snapshot = EngineSnapshot(0, 0, 0.0, 0, 0, 0, 0)
        self._publish()

    # ---- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the worker. The calling thread (usually the one that built the engine) first gives back its OpenMP
        threads, so that the worker's are the process's only ones (kernels/threads.py: 2.8x faster decode steps
        on 2 cores)."""
        if self._thread is None:
            release_openmp_threads()
            self._thread = threading.Thread(target=self._run, name="verispec-engine", daemon=True)
            self._thread.start()

    def is_alive(self) -> bool:
        """The worker thread is running (False before start() and after shutdown() or a crash)."""
        return self._thread is not None and self._thread.is_alive()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    # ---- from any thread --------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> RequestStream:
        self.validate(prompt_ids)
        req = Request(list(prompt_ids), params) if request_id is None else Request(list(prompt_ids), params, request_id)
        self.engine.check_fits(req)
        with self._lock:
            in_flight = len(self._streams)
            capacity = self.engine.config.max_num_seqs + self.max_waiting
            if in_flight >= capacity:
                raise EngineOverloaded(
                    f"the server is at capacity ({in_flight} requests in flight, {self.max_waiting} may wait); "
                    "retry later", retry_after=1.0)
            stream = RequestStream(req, self)
            self._streams[req.request_id] = stream
            self._inbox.append((req, stream))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    def fail_in_flight(self, message: str) -> None:
        """End every request in flight (running, waiting, submitted) with finish_reason "error" and `message`, at
        the worker's next turn; the engine goes on and takes new requests (the server's shutdown after its grace
        period)."""
        with self._lock:
            self._fail = message
        self._wake.set()

    def reset_prefix_cache(self) -> Future:
        """Forget the prefix cache's blocks at the worker's next turn, before it admits anything submitted since.
        The future's result: True when done, False (nothing changed) while any request runs or waits in the
        engine. The hit counters stay lifetime totals (state/paged_kv.py)."""
        done: Future = Future()
        with self._lock:
            self._resets.append(done)
        self._wake.set()
        return done

    def snapshot(self) -> EngineSnapshot:
        """The engine's state as the worker last published it (after its latest step), plus the inbox."""
        with self._lock:
            snap, inbox = self._snapshot, len(self._inbox)
        return replace(snap, num_waiting=snap.num_waiting + inbox)

    def _publish(self) -> None:  # on the worker thread, between steps
        e = self.engine
        c = e.counters
        snap = EngineSnapshot(
            num_running=len(e.running), num_waiting=len(e.waiting), kv_usage=e.kv_usage(),
            kv_tokens=e.kv_tokens(), num_drafts=c.num_drafts, num_draft_tokens=c.num_draft_tokens,
            num_accepted_tokens=c.num_accepted_tokens, accepted_per_pos=list(c.accepted_per_pos),
            num_finished=e.num_finished, prefix_cache_queries=e.cache.prefix_queries,
            prefix_cache_hits=e.cache.prefix_hits, num_preemptions=e.num_preemptions,
            engine_steps=e.clock.steps, forward_tokens=e.clock.forward_tokens, step_seconds=dict(e.clock.seconds))
        with self._lock:
            self._snapshot = snap

    # ---- the worker -------------------------------------------------------------------------------
    def _on_tokens(self, req: Request, tokens: list[int]) -> None:
        stream = self._streams.get(req.request_id)
        if stream is None:
            return
        reason = req.finish_reason
        lps = req.output_logprobs[len(req.output_ids) - len(tokens):] if req.params.logprobs is not None else None
        stream._push(TokenEvent(list(tokens), reason, req.error if reason == "error" else None, req.stop_reason,
                                req.stop_text, lps, req.stats.queue_s if reason is not None else None))
        if reason is not None:
            with self._lock:
                self._streams.pop(req.request_id, None)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            fail, self._fail = self._fail, None
            resets, self._resets = self._resets, []
        if resets:
            ok = not self.engine.has_work() and self.engine.cache.reset_prefix_cache()
            for done in resets:
                done.set_result(ok)
        for req, _ in inbox:
            self.engine.add_request(req, self._on_tokens)
        for rid in aborts:
            self.engine.abort(rid)
        if fail is not None:
            self.engine.fail_all(fail)

    def _run(self) -> None:
        while not self._stop:
            self._drain_inbox()
            if not self.engine.has_work():
                self._publish()
                self._wake.wait(self._idle_wait_s)
                self._wake.clear()
                continue
            try:
                self.engine.step()
            except Exception as exc:  # noqa: BLE001 - one bad step must not take the server down
                log.exception("engine step failed")
                self.engine.fail_all(f"internal error while generating: {type(exc).__name__}: {exc}")
            self._publish()
        self.engine.fail_all("the server is shutting down")
        self._publish()
