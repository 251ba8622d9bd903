"""The router's operator routes.

    GET|POST|DELETE /admin/instances   list, add ({url, role}), remove (?url=...); off (403)
                                       unless disaggregation.router_admin_key is set, then they
                                       need it as a bearer key (401)
    GET  /health                       200 {"status": "ok"} while a decode-capable instance is in
                                       rotation, else 503 {"status": "not_ready"}; the instances
                                       and their errors only to a caller with the admin key
    GET  /version, /metrics            the router's version and metrics

An instance added here gets the router's cluster secret and its clients' prompts: a router
without the secret refuses prefill and decode instances (400), as it refuses to start over them.
"""
from __future__ import annotations

import httpx
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import SecretStr

from tandem import __version__
from tandem.config import InstanceConfig, Role
from tandem.router.auth import admin_check, has_bearer
from tandem.router.errors import RouterError
from tandem.router.metrics import RouterMetrics
from tandem.router.registry import DuplicateInstance, InstanceRegistry, Step


def admin_routes(registry: InstanceRegistry, health_client: httpx.AsyncClient,
                 admin_key: SecretStr | None, hand_overs_allowed: bool) -> APIRouter:
    """``hand_overs_allowed``: the router has the cluster secret (or may go without)."""
    router = APIRouter(prefix="/admin", dependencies=[Depends(admin_check(admin_key))])

    @router.get("/instances")
    async def list_instances() -> dict:
        return {"instances": [s.as_dict() for s in registry.all()]}

    @router.post("/instances", status_code=201)
    async def add_instance(instance: InstanceConfig) -> dict:
        """Add an instance; it is health-checked at once and in rotation if it answers."""
        if instance.role is not Role.BOTH and not hand_overs_allowed:
            raise RouterError(400, f"a {instance.role} instance needs the cluster secret, which this router "
                                   "does not have (disaggregation.kv_transfer_secret)",
                              code="no_kv_transfer_secret", param="role")
        try:
            state = registry.add(instance.url, instance.role)
        except DuplicateInstance as exc:
            raise RouterError(409, str(exc), code="instance_exists", param="url") from exc
        except ValueError as exc:
            raise RouterError(400, str(exc), code="invalid_url", param="url") from exc
        await registry.check(state, health_client)
        return state.as_dict()

    @router.delete("/instances")
    async def remove_instance(url: str) -> dict:
        """Remove an instance: no new requests go to it; those in flight finish."""
        try:
            state = registry.remove(url.rstrip("/"))
        except KeyError:
            raise RouterError(404, f"no instance {url} is registered", code="unknown_instance",
                              param="url") from None
        return state.as_dict()

    return router


def add_operator_routes(app: FastAPI, registry: InstanceRegistry, metrics: RouterMetrics,
                        admin_key: SecretStr | None) -> None:
    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        """200 while at least one decode-capable instance is in rotation, else 503; the
        instances only with the admin key."""
        ready = bool(registry.candidates(Step.DECODE))
        body: dict = {"status": "ok" if ready else "not_ready"}
        if admin_key is not None and has_bearer(request, admin_key):
            body["instances"] = [s.as_dict() for s in registry.all()]
        return JSONResponse(body, status_code=200 if ready else 503)

    @app.get("/version")
    async def version() -> dict:
        """The router's tandem version."""
        return {"version": __version__}

    @app.get("/metrics")
    async def router_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
