"""The Ray Serve application: a router ingress (FastAPI) and one deployment per specialist.

`serve run deploy/ensemble.yaml` imports `router.app:build_app` with the config's `args`
(validated as `AppArgs`). Deployments are named "router" and after each specialist, so the config's
`deployments:` entries (replicas, CPUs/GPUs, user_config with the speculation policy) apply by name.

Tracing: each replica builds its own TracerProvider in __init__ from the OTEL_* environment
(specialists/telemetry.py); Serve's built-in tracing (RAY_SERVE_TRACING_*) is independent of it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, model_validator
from ray import serve
from ray.exceptions import LocalRayletDiedError, NodeDiedError, RayActorError, TaskCancelledError, WorkerCrashedError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle

from router.backends import BackendUnavailable
from router.classifier import ContentClassifier
from router.http import build_http_app
from router.limits import RequestLimits
from router.routing import AUTO, Router
from router.service import ChatService, ServiceSettings
from specialists.deployment import HEALTH_CHECK_PERIOD_S, SpecialistOptions, specialist_deployment
from specialists.telemetry import tracer_provider_from_env

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SPECIALISTS = ["cpp", "python", "build", "shell"]


def resolve_path(path: str) -> str:
    """A path from the config: as given when it exists (relative to the working directory), else
    relative to the repository root (Serve may build the app in another working directory)."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return str(p.resolve())
    return str((REPO_ROOT / p).resolve())


class AppArgs(BaseModel):
    """The `args:` of the application in deploy/*.yaml."""

    model_config = ConfigDict(extra="forbid")

    models_dir: str = "deploy/models"  # one subdirectory per specialist
    specialists: list[str] = Field(default_factory=lambda: list(DEFAULT_SPECIALISTS), min_length=1)
    default_specialist: str = "python"  # answers "auto" requests the classifier is unsure about
    route_threshold: float = Field(0.5, ge=0.0, le=1.0)
    router_dir: str | None = "deploy/router"  # the content classifier; None or missing: no classifier
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    max_num_seqs: int = Field(16, ge=1)
    max_model_len: int | None = Field(None, ge=16)
    num_threads: int | None = Field(1, ge=1)  # torch threads per specialist replica (CPU)
    default_max_tokens: int = Field(256, ge=1)
    default_temperature: float = Field(0.0, ge=0.0, le=2.0)
    admin_token_env: str = "CANTATA_ADMIN_TOKEN"
    recovery_wait_s: float = Field(15.0, ge=0.0)  # a request waits this long for a dead replica's restart
    limits: RequestLimits = Field(default_factory=RequestLimits)  # body size/timeout, tool schemas (router/limits.py)

    @model_validator(mode="after")
    def _check(self) -> "AppArgs":
        if len(set(self.specialists)) != len(self.specialists) or AUTO in self.specialists:
            raise ValueError(f"specialists must be unique and not {AUTO!r}: {self.specialists}")
        if self.default_specialist not in self.specialists:
            raise ValueError(f"default_specialist {self.default_specialist!r} is not among {self.specialists}")
        return self

    def specialist_options(self, name: str) -> SpecialistOptions:
        return SpecialistOptions(name=name, model_dir=resolve_path(str(Path(self.models_dir) / name)),
                                 device=self.device, dtype=self.dtype, max_num_seqs=self.max_num_seqs,
                                 max_model_len=self.max_model_len, num_threads=self.num_threads)

    def settings(self) -> ServiceSettings:
        return ServiceSettings(default_max_tokens=self.default_max_tokens,
                               default_temperature=self.default_temperature, limits=self.limits,
                               recovery_wait_s=self.recovery_wait_s)


def load_router(args: AppArgs) -> Router:
    classifier = None
    if args.router_dir:
        path = Path(resolve_path(args.router_dir))
        if path.exists():
            classifier = ContentClassifier.load(path)
        else:
            log.warning("no content classifier at %s: 'auto' goes to %s", path, args.default_specialist)
    return Router(args.specialists, classifier, args.default_specialist, args.route_threshold)


class HandleBackend:
    """A specialist deployment behind a Serve handle (the router's SpecialistBackend). Ray's errors
    stop here: a dead, unreachable, overloaded or cancelled replica is raised as BackendUnavailable."""

    def __init__(self, name: str, handle: DeploymentHandle) -> None:
        self.name = name
        self.handle = handle

    async def generate(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        done = False
        stream = None
        try:
            stream = self.handle.options(stream=True).generate.remote(request)
            async for event in stream:
                yield event
            done = True
        except RAY_UNAVAILABLE as exc:
            raise unavailable(self.name, exc) from exc
        finally:
            if not done and stream is not None:
                stream.cancel()

    async def ready(self, timeout_s: float) -> bool:
        try:
            return bool(await asyncio.wait_for(self.handle.ready.remote(), timeout_s))
        except RAY_UNAVAILABLE as exc:
            raise unavailable(self.name, exc) from exc

    async def get_policy(self) -> dict[str, Any]:
        try:
            return await self.handle.get_policy.remote()
        except RAY_UNAVAILABLE as exc:
            raise unavailable(self.name, exc) from exc

    async def set_policy(self, policy: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.handle.set_policy.remote(policy)
        except RAY_UNAVAILABLE as exc:
            raise unavailable(self.name, exc) from exc


# Ray's errors for "the replica cannot answer", mapped to ours at this edge (the service sees no Ray).
_GONE = (RayActorError, WorkerCrashedError, NodeDiedError, LocalRayletDiedError, DeploymentUnavailableError,
         ReplicaUnavailableError)  # RayActorError covers ActorDiedError and ActorUnavailableError
RAY_UNAVAILABLE = (*_GONE, BackPressureError, TaskCancelledError)  # RequestCancelledError is a TaskCancelledError


def unavailable(name: str, exc: BaseException) -> BackendUnavailable:
    """Our error for one of RAY_UNAVAILABLE: a replica that died or cannot be reached restarts
    (Serve replaces it); back pressure and cancellation do not."""
    if isinstance(exc, BackPressureError):
        return BackendUnavailable(name, "overloaded", type(exc).__name__, restarts=False)
    if isinstance(exc, TaskCancelledError):
        return BackendUnavailable(name, "cancelled", type(exc).__name__, restarts=False)
    return BackendUnavailable(name, "replica_died", type(exc).__name__, restarts=True)


@serve.ingress()
class RouterIngress:
    """The HTTP entry point; the FastAPI app is built per replica (`__serve_build_asgi_app__`)."""

    def __init__(self, handles: dict[str, DeploymentHandle], args: dict[str, Any]) -> None:
        self.args = AppArgs.model_validate(args)
        backends = {name: HandleBackend(name, handle) for name, handle in handles.items()}
        self.service = ChatService(backends, load_router(self.args), tracer_provider_from_env("router"),
                                   self.args.settings())
        self.admin_token = os.environ.get(self.args.admin_token_env) or None
        log.info("router: specialists %s, default %s, admin routes %s", list(backends), self.args.default_specialist,
                 "on" if self.admin_token else "off")

    def __serve_build_asgi_app__(self) -> FastAPI:
        return build_http_app(self.service, self.admin_token, request_ids=False)  # Serve's proxy sets x-request-id


def build_app(args: dict[str, Any]) -> Any:
    """The Serve application (import path `router.app:build_app`)."""
    parsed = AppArgs.model_validate(args or {})
    handles = {name: specialist_deployment(name=name, ray_actor_options={"num_cpus": 0.4})
               .bind(parsed.specialist_options(name).model_dump()) for name in parsed.specialists}
    ingress = serve.deployment(RouterIngress, name="router", ray_actor_options={"num_cpus": 0.2},
                               max_ongoing_requests=256, health_check_period_s=HEALTH_CHECK_PERIOD_S)
    return ingress.bind(handles, parsed.model_dump())
