"""The bearer token: required for actions (submit, cancel), and for reads when they are
closed. One token, configured at startup (BERTH_API_TOKEN)."""

from __future__ import annotations

import hmac

from litestar.connection import ASGIConnection
from litestar.exceptions import NotAuthorizedException, PermissionDeniedException
from litestar.handlers.base import BaseRouteHandler
from litestar.types import Guard


def _check(connection: ASGIConnection, token: str) -> None:  # type: ignore[type-arg]
    scheme, _, given = connection.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given:
        raise NotAuthorizedException(
            "a bearer token is required: send 'Authorization: Bearer <token>'",
            headers={"WWW-Authenticate": "Bearer"})
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise NotAuthorizedException("the bearer token is not the one berth was started with",
                                     headers={"WWW-Authenticate": 'Bearer error="invalid_token"'})


def action_guard(token: str) -> Guard:
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        if not token:
            raise PermissionDeniedException(
                "actions are disabled: start the dashboard with BERTH_API_TOKEN set")
        _check(connection, token)

    return guard


def read_guard(token: str, closed: bool) -> Guard:
    def guard(connection: ASGIConnection, _: BaseRouteHandler) -> None:  # type: ignore[type-arg]
        if closed:
            _check(connection, token)

    return guard
