"""The engine thread: a background thread that owns an Engine and runs its steps, so a replica's
event loop stays responsive while the (synchronous) forward passes run.

Everything that touches the engine runs in that thread (adding requests, steps, policy changes,
warm-up); other threads post callables to it (`call`, `acall`) or submit requests (`submit`), whose
outputs arrive on an asyncio.Queue of `Admitted`, `Snapshot` and `Failed` items. Snapshots copy the
engine's live statistics inside the thread. No Ray here: `specialists.deployment` wraps this.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from specialists.sampling import SamplingParams

if TYPE_CHECKING:
    from specialists.engine import Engine

log = logging.getLogger(__name__)

T = TypeVar("T")


class EngineLoopStopped(RuntimeError):
    """The engine thread is not running (stopped, or died on an error)."""


@dataclass
class Admitted:
    """The engine took the request (tokenized and queued it)."""

    time_ns: int


@dataclass
class Snapshot:
    """One output of the request: cumulative text and token count."""

    time_ns: int
    prompt_tokens: int
    num_tokens: int
    text: str
    finish_reason: str | None
    finished: bool
    speculation: str
    stats: dict[str, Any] = field(default_factory=dict)  # only on the finished snapshot


@dataclass
class Failed:
    """The request could not be served: status 400 for a bad request, 500 for an engine error."""

    status: int
    message: str


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: object) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            pass


class EngineLoop:
    """Owns `engine` and steps it in a daemon thread named `engine-loop-{name}`; `request_error` is
    the engine's exception for a bad request (answered as a 400 `Failed`, not an engine error)."""

    def __init__(self, engine: Engine, name: str = "engine", request_error: type[Exception] = ValueError) -> None:
        self.engine = engine
        self.name = name
        self._request_error = request_error
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"engine-loop-{name}", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # ---- calls from other threads ----------------------------------------------------------------

    def call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        """Run `fn` in the engine thread between steps; its result or exception in the future."""
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self.alive:
            fut.set_exception(EngineLoopStopped(f"{self.name}: engine thread stopped ({self.error!r})"))
            return fut

        def run() -> None:
            if not fut.set_running_or_notify_cancel():
                return
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

        self._post(run)
        return fut

    async def acall(self, fn: Callable[[], T]) -> T:
        return await asyncio.wrap_future(self.call(fn))

    def submit(self, prompt: str | list[int], params: SamplingParams, request_id: str) -> asyncio.Queue:
        """Queue a request; must be called from a running event loop, whose queue gets the items."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue())
        if not self.alive:
            sink.queue.put_nowait(Failed(503, f"{self.name}: engine thread stopped"))
            return sink.queue

        def add() -> None:
            try:
                self.engine.add_request(prompt, params, request_id)
            except self._request_error as exc:
                sink.put(Failed(400, str(exc)))
                return
            except Exception as exc:  # noqa: BLE001 - a bad request must not end the loop
                log.exception("%s: add_request failed", self.name)
                sink.put(Failed(500, f"{type(exc).__name__}: {exc}"))
                return
            self._sinks[request_id] = sink
            sink.put(Admitted(time.time_ns()))

        self._post(add)
        return sink.queue

    def abort(self, request_id: str) -> None:
        """Stop delivering outputs of a request and stop it in the engine."""

        def drop() -> None:
            self._sinks.pop(request_id, None)
            self.engine.abort(request_id)

        if self.alive:
            self._post(drop)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    # ---- the engine thread -----------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as exc:  # noqa: BLE001 - recorded, reported by check_health
            log.exception("%s: engine loop died", self.name)
            self.error = exc
            for sink in self._sinks.values():
                sink.put(Failed(500, f"engine error: {type(exc).__name__}: {exc}"))
            self._sinks.clear()
            self._fail_inbox(exc)

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def _fail_inbox(self, exc: BaseException) -> None:
        while True:
            try:
                self._inbox.get_nowait()()
            except queue.Empty:
                return
            except BaseException:  # noqa: BLE001 - best effort after a crash
                log.debug("inbox item failed after the engine loop died", exc_info=True)

    def _step(self) -> None:
        outs = self.engine.step()
        now = time.time_ns()
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if out.finished:
                self._sinks.pop(out.request_id, None)
            if sink is None:
                continue
            stats = out.stats.as_dict() if out.finished and out.stats is not None else {}
            sink.put(Snapshot(now, len(out.prompt_token_ids), len(out.token_ids), out.text, out.finish_reason, out.finished,
                              out.speculation, stats))


def warm_up_engine(engine: Engine) -> float:
    """Warm the engine before the replica reports ready (`Engine.warmup`: decode and verify shapes).
    Returns the seconds it took. Call it in the engine thread (`EngineLoop.call`)."""
    t0 = time.perf_counter()
    engine.warmup()
    return time.perf_counter() - t0
