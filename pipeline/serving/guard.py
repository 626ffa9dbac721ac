"""An ASGI middleware in front of every route of the app: API key, request size, and the checks vLLM leaves out.

Ray Serve LLM's router has no API key check (its /tokenize, /detokenize, /docs and /openapi.json answer anyone),
Python's json turns a deeply nested body into a 500, and vLLM silently shortens a `max_tokens` past the context and
accepts an empty message list. Here the key guards every route below root_path but the health probe, every body
is held to max_request_bytes, and each bad body is a 4xx with a message that names the field.
"""

from __future__ import annotations

import hmac
import json
from typing import Any, Optional

GENERATION_ROUTES = ("/v1/chat/completions", "/v1/completions")
# Liveness probes carry no key (Ray Serve's proxy answers its own /-/healthz before the app sees it).
OPEN_ROUTES = ("/health", "/-/healthz")
BODY_METHODS = ("POST", "PUT", "PATCH")
# Deeper than any OpenAI request, tool schema included; Python's json would raise RecursionError (a 500) near 1000.
MAX_JSON_DEPTH = 64


def route_of(scope: dict) -> str:
    """The path below the app's root_path (Ray Serve's route_prefix): the route the app's router matches."""
    path, root = scope.get("path") or "/", (scope.get("root_path") or "").rstrip("/")
    if root and (path == root or path.startswith(root + "/")):
        path = path[len(root):] or "/"
    return path


def json_depth(value: Any) -> int:
    """How deeply lists and objects nest in a parsed JSON value, without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, level + 1) for child in children if isinstance(child, (dict, list)))
    return deepest if isinstance(value, (dict, list)) else 0


def _payload(body: bytes) -> tuple[Any, Optional[str]]:
    try:
        payload = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        return None, f"the request body is not valid JSON ({error})"
    except RecursionError:
        return None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    if not isinstance(payload, dict):
        return None, "the request body must be a JSON object"
    if json_depth(payload) > MAX_JSON_DEPTH:
        return None, f"the request body nests deeper than {MAX_JSON_DEPTH} levels"
    return payload, None


def request_problem(path: str, body: bytes, max_model_len: int) -> Optional[str]:
    """What is wrong with a JSON request body for the route `path` (None: nothing we check): not JSON, not an
    object, nested too deeply; for the generation routes also no messages / prompt, or a max_tokens the context
    cannot hold."""
    payload, problem = _payload(body)
    if problem or path not in GENERATION_ROUTES:
        return problem
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

    def _authorized(self, headers: dict) -> bool:
        # Bytes on both sides: compare_digest refuses a str holding non-ASCII characters.
        given = headers.get(b"authorization", b"")
        return hmac.compare_digest(given, b"Bearer " + (self.api_key or "").encode("utf-8"))

    async def _websocket(self, scope: dict, receive: Any, send: Any) -> None:
        """A websocket (vLLM's realtime routes) needs the key like any route: without it the handshake is closed
        before it is accepted (ASGI: the server answers 403), code 1008 (policy violation)."""
        headers = dict(scope.get("headers") or [])
        if self.api_key and route_of(scope) not in OPEN_ROUTES and not self._authorized(headers):
            await receive()  # websocket.connect
            return await send({"type": "websocket.close", "code": 1008})
        return await self.app(scope, receive, send)

    async def _read_body(self, receive: Any) -> Optional[bytes]:
        """The whole body, or None once it is larger than max_request_bytes."""
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_request_bytes:
                return None
        return body

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "websocket":
            return await self._websocket(scope, receive, send)
        if scope["type"] != "http":  # lifespan
            return await self.app(scope, receive, send)
        route, headers = route_of(scope), dict(scope.get("headers") or [])
        if self.api_key and route not in OPEN_ROUTES and not self._authorized(headers):
            return await self._reply(send, 401, "missing or wrong API key (Authorization: Bearer <key>)",
                                     "authentication_error")
        if scope["method"] not in BODY_METHODS:
            return await self.app(scope, receive, send)
        too_large = f"the request is larger than {self.max_request_bytes} bytes"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_request_bytes:
            return await self._reply(send, 413, too_large, "invalid_request_error")
        body = await self._read_body(receive)
        if body is None:
            return await self._reply(send, 413, too_large, "invalid_request_error")
        if not headers.get(b"content-type", b"").startswith(b"multipart/"):  # audio uploads are not JSON
            problem = request_problem(route, body, self.max_model_len)
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
