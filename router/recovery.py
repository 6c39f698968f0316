"""Waiting out a specialist's restart: when its replica dies (BackendUnavailable with `restarts`),
a request that has produced nothing for its client is sent once more after the specialist is ready
again. Every request that waits on the same specialist shares one readiness poll (bounded backoff,
at most `wait_s`); when the specialist is not back in time, or the error is not one that restarts
(back pressure, cancellation), the client gets a 503 with Retry-After in OpenAI's error shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from router.api import ServiceUnavailableError
from router.backends import BackendUnavailable

log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.25  # the poll's backoff: 0.25, 0.5, 1, 1, ... s between readiness probes
MAX_DELAY_S = 1.0


class Recovery:
    def __init__(self, probe: Callable[[str], Awaitable[bool]], wait_s: float, retry_after_s: int) -> None:
        self.probe = probe  # True when the specialist answers ready (ChatService._probe)
        self.wait_s = wait_s
        self.retry_after_s = retry_after_s
        self._polls: dict[str, asyncio.Task[bool]] = {}

    def error(self, exc: BackendUnavailable) -> ServiceUnavailableError:
        """The client's 503 for an unavailable specialist."""
        if exc.reason == "overloaded":
            message = f"specialist {exc.specialist!r} is overloaded; retry shortly"
        elif exc.reason == "cancelled":
            message = f"the request to specialist {exc.specialist!r} was cancelled"
        else:
            message = f"specialist {exc.specialist!r} is restarting (its replica stopped); retry shortly"
        return ServiceUnavailableError(message, retry_after_s=self.retry_after_s, code=f"specialist_{exc.reason}")

    async def before_retry(self, exc: BackendUnavailable) -> None:
        """Return when the specialist is ready for the one retry; raise the client's 503 when the
        error does not restart or the specialist is not back within `wait_s`."""
        if not exc.restarts:
            raise self.error(exc) from None
        log.warning("%s; waiting up to %.0f s to send the request again", exc, self.wait_s)
        if not await self.wait(exc.specialist):
            raise self.error(exc) from None

    async def wait(self, name: str) -> bool:
        """True once `name` answers ready (within `wait_s`); one shared poll per specialist."""
        task = self._polls.get(name)
        if task is None or task.done():
            task = asyncio.create_task(self._poll(name), name=f"recovery-{name}")
            self._polls[name] = task
        return await asyncio.shield(task)  # a client that leaves does not cancel the others' wait

    async def _poll(self, name: str) -> bool:
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.wait_s
        delay = FIRST_DELAY_S
        while True:
            await asyncio.sleep(min(delay, max(deadline - loop.time(), 0.0)))
            if await self.probe(name):
                log.info("specialist %r is ready again after %.1f s", name, loop.time() - start)
                return True
            if loop.time() >= deadline:
                log.warning("specialist %r not ready after %.1f s", name, loop.time() - start)
                return False
            delay = min(delay * 2, MAX_DELAY_S)
