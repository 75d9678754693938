"""The API key: every route but /health asks for 'Authorization: Bearer <key>' when the server has one."""
from __future__ import annotations

import secrets

from fastapi import Request

from .protocol import APIError


def key_check(api_key: str | None):
    """A dependency of every route but /health: 'Authorization: Bearer <api_key>' when the server has a key,
    compared in constant time. (A dependency, not an HTTP middleware: Starlette's middleware wraps the
    connection's messages, and a handler behind it can miss the client's disconnect.)"""
    want = f"Bearer {api_key}".encode() if api_key is not None else None

    async def check_key(request: Request):
        if want is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), want):
            what = "a wrong API key" if given else "no API key"
            raise APIError(401, f"{what}: send the header 'Authorization: Bearer <key>' with the server's "
                                f"--api-key", code="invalid_api_key")
    return check_key
