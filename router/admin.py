"""Admin routes: read and replace speculation policies while the server runs.

  GET /admin/policies                 every specialist's policy, gate status and current speculation
  GET /admin/policies/{specialist}    one of them
  PUT /admin/policies/{specialist}    body: a SpeculationPolicy (missing fields take their defaults)
  PUT /admin/policies                 body: a PolicySet {"default": {...}, "specialists": {name: {...}}};
                                      every specialist gets policy_for(name)

A PUT reaches the specialist's replica through its handle (`set_policy`) and applies from its next
engine step, without a restart. The routes need `Authorization: Bearer <CANTATA_ADMIN_TOKEN>`: they
answer 404 when no token is configured and 401 without the right one. With more than one replica per
specialist a handle call reaches one replica; use `serve deploy` (user_config) to reach them all.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError

from policies.policy import PolicySet, SpeculationPolicy
from router.api import AuthenticationError, BadRequestError, NotFoundError, UnprocessableError
from router.service import ChatService


def check_token(request: Request, token: str | None) -> None:
    if not token:
        raise NotFoundError(f"no route {request.url.path}", code="not_found")
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise AuthenticationError("admin routes need 'Authorization: Bearer <CANTATA_ADMIN_TOKEN>'",
                                  code="invalid_token", headers={"WWW-Authenticate": "Bearer"})


async def _json_object(request: Request) -> dict[str, Any]:
    """The body as a JSON object (read after the token check, so a bad token is always a 401)."""
    try:
        body = json.loads(await request.body() or b"null")
    except ValueError as exc:
        raise BadRequestError(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequestError("the body must be a JSON object", code="invalid_json")
    return body


def _validated(model: type[SpeculationPolicy] | type[PolicySet], body: Any) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise UnprocessableError(f"invalid policy: {exc}", param=param, code="invalid_policy") from None


def admin_router(service: ChatService, token: str | None) -> APIRouter:
    router = APIRouter(prefix="/admin")

    async def apply(name: str, policy: SpeculationPolicy) -> dict[str, Any]:
        result = await service.backend(name).set_policy(policy.model_dump())
        if not result.get("ok", False):
            raise BadRequestError(f"{name}: {result.get('error')}", param="policy", code="policy_rejected")
        return result

    @router.get("/policies")
    async def get_policies(request: Request) -> dict[str, Any]:
        check_token(request, token)
        names = list(service.backends)
        views = await asyncio.gather(*(service.backends[n].get_policy() for n in names))
        return {"specialists": dict(zip(names, views))}

    @router.get("/policies/{specialist}")
    async def get_policy(specialist: str, request: Request) -> dict[str, Any]:
        check_token(request, token)
        return await service.backend(specialist).get_policy()

    @router.put("/policies/{specialist}")
    async def put_policy(specialist: str, request: Request) -> dict[str, Any]:
        check_token(request, token)
        service.backend(specialist)
        return await apply(specialist, _validated(SpeculationPolicy, await _json_object(request)))

    @router.put("/policies")
    async def put_policies(request: Request) -> dict[str, Any]:
        check_token(request, token)
        policies: PolicySet = _validated(PolicySet, await _json_object(request))
        for name in policies.specialists:
            service.backend(name)
        names = list(service.backends)
        results = await asyncio.gather(*(apply(n, policies.policy_for(n)) for n in names))
        return {"specialists": dict(zip(names, results))}

    return router
