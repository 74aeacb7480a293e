"""The API-key rule of both HTTP apps, the VLM server (``/v1``) and the events ui (``/api``):
``Authorization: Bearer <key>``, the key compared in constant time."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request


def bearer_key_dependency(
    api_key: str | None, error: Callable[..., Exception]
) -> Callable[[Request], Awaitable[None]]:
    """A FastAPI dependency that lets a request through only with the key; a no-op when no key
    is configured. A missing or wrong key raises ``error(401, message, code="invalid_api_key",
    headers={"www-authenticate": "Bearer"})``: ``error`` is the app's own error class, so each
    app answers in its own error body."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise error(
                401,
                "Incorrect or missing API key." if header else "No API key provided.",
                code="invalid_api_key",
                headers={"www-authenticate": "Bearer"},
            )

    return check
