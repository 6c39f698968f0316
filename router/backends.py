"""How the router talks to a specialist: the `SpecialistBackend` protocol, and `LocalBackend` for a
`Specialist` in the same process (tests, scripts). router/app.py has the Serve-handle backend.

Every call carries plain dicts (GenerateRequest in, GenerateEvent dicts out), so the router's code
path is the same whether the specialist is local or behind a Serve handle.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry.sdk.trace import TracerProvider

if TYPE_CHECKING:  # the router's HTTP side imports no torch: the engine loads only in local_specialists
    from specialists.deployment import Specialist


class BackendUnavailable(RuntimeError):
    """A specialist cannot run the request: its replica died or is unreachable (`reason`
    "replica_died"), it is overloaded ("overloaded"), or the call was cancelled ("cancelled").
    Backends raise it instead of their transport's errors (router/app.py maps Ray's), so the
    service sees one type. `restarts`: the deployment will come back (a request that produced
    nothing may be sent again once it is ready)."""

    def __init__(self, specialist: str, reason: str, detail: str = "", *, restarts: bool) -> None:
        super().__init__(f"specialist {specialist!r} unavailable ({reason}){': ' + detail if detail else ''}")
        self.specialist = specialist
        self.reason = reason
        self.restarts = restarts


class SpecialistBackend(Protocol):
    name: str

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """GenerateEvent dicts: start, text..., end, or one error; raises BackendUnavailable when
        the specialist's process is gone or cannot take the request."""
        ...

    async def ready(self, timeout_s: float) -> bool:
        """True when the specialist is warmed up; False when it is not or does not answer in time."""
        ...

    async def get_policy(self) -> dict[str, Any]: ...

    async def set_policy(self, policy: dict[str, Any]) -> dict[str, Any]: ...


class LocalBackend:
    """A Specialist object in this process."""

    def __init__(self, specialist: Specialist) -> None:
        self.specialist = specialist
        self.name = specialist.name

    def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        return self.specialist.generate(request)

    async def ready(self, timeout_s: float) -> bool:
        return self.specialist.ready()

    async def get_policy(self) -> dict[str, Any]:
        return await self.specialist.get_policy()

    async def set_policy(self, policy: dict[str, Any]) -> dict[str, Any]:
        return await self.specialist.set_policy(policy)

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until warmed up (tests)."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not self.specialist.ready():
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"{self.name} did not warm up in {timeout_s} s")
            await asyncio.sleep(0.02)


def local_specialists(names: list[str], models_dir: str | Path, tracer_provider: TracerProvider | None = None,
                      **options: Any) -> dict[str, Specialist]:
    """In-process specialists (no Ray), one per name, loading `models_dir/<name>`; they warm up in
    their engine threads (see LocalBackend.wait_ready)."""
    from specialists.deployment import Specialist, SpecialistOptions

    return {n: Specialist(SpecialistOptions(name=n, model_dir=str(Path(models_dir) / n), **options),
                          tracer_provider=tracer_provider) for n in names}
