"""The router's bearer-key checks: the clients' API key on the public routes, the operator's
admin key on /admin/*. Keys are compared in constant time, as the bytes that came."""
from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request
from pydantic import SecretStr

from tandem.router.errors import RouterError


def has_bearer(request: Request, key: SecretStr) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <key>``."""
    given = request.headers.get("authorization", "").encode("latin-1")
    return hmac.compare_digest(given, f"Bearer {key.get_secret_value()}".encode())


def bearer_check(key: SecretStr | None, what: str, code: str) -> Callable[[Request], Awaitable[None]]:
    """A dependency: 401 ``code`` unless the request carries ``key`` (nothing to check without one)."""
    async def check(request: Request) -> None:
        if key is not None and not has_bearer(request, key):
            raise RouterError(401, f"{what}: Authorization: Bearer KEY", code=code)

    return check


def admin_check(key: SecretStr | None) -> Callable[[Request], Awaitable[None]]:
    """A dependency of the admin routes: off (403) without an admin key, 401 without this key."""
    check = bearer_check(key, "the router's admin key is required", "invalid_admin_key")

    async def check_admin(request: Request) -> None:
        if key is None:
            raise RouterError(403, "the router's admin API is off: set disaggregation.router_admin_key "
                                   "(or router_admin_key_file) to turn it on", code="admin_api_disabled")
        await check(request)

    return check_admin
