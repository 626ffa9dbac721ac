"""An ASGI middleware in front of the OpenAI routes: API key, request size, and the checks vLLM leaves out.

Ray Serve LLM's router has no API key check, and vLLM silently shortens a `max_tokens` past the context and
accepts an empty message list; here each of those is a 4xx with a message that names the field.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Optional

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")


def request_problem(path: str, body: bytes, max_model_len: int) -> Optional[str]:
    """What is wrong with a generation request's JSON body (None: nothing we check)."""
    try:
        payload = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return f"the request body is not valid JSON ({error})"
    if not isinstance(payload, dict):
        return "the request body must be a JSON object"
    if path == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return "messages: must be a non-empty list of {role, content}"
    elif "prompt" not in payload or payload["prompt"] in ("", [], None):
        return "prompt: must be a non-empty string or list"
    for field in ("max_tokens", "max_completion_tokens"):
        value = payload.get(field)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{field}: must be a positive integer"
        if value >= max_model_len:
            return f"{field}: {value} does not fit the model's context of {max_model_len} tokens"
    return None


def _error_body(status: int, message: str, kind: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": kind, "code": status}}).encode()


class RequestGuard:
    """Pure ASGI middleware (it must see the raw body before FastAPI parses it)."""

    def __init__(self, app: Any, api_key: Optional[str] = None, max_request_bytes: int = 1 << 20,
                 max_model_len: int = 2048):
        self.app, self.api_key = app, api_key
        self.max_request_bytes, self.max_model_len = max_request_bytes, max_model_len

    async def _reply(self, send: Any, status: int, message: str, kind: str) -> None:
        body = _error_body(status, message, kind)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def _authorized(self, scope: dict) -> bool:
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"authorization", b"").decode("latin-1")
        return hmac.compare_digest(given, f"Bearer {self.api_key}")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        if self.api_key and not self._authorized(scope):
            return await self._reply(send, 401, "missing or wrong API key (Authorization: Bearer <key>)",
                                     "authentication_error")
        if scope["method"] != "POST" or scope["path"] not in GENERATION_ROUTES:
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_request_bytes:
                return await self._reply(send, 413, f"the request is larger than {self.max_request_bytes} bytes",
                                         "invalid_request_error")
        problem = request_problem(scope["path"], body, self.max_model_len)
        if problem:
            return await self._reply(send, 400, problem, "invalid_request_error")
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later messages: the client disconnecting

        await self.app(scope, replay, send)
