"""The client's raw request body, captured before pydantic parses it, for the ds4 renderer.

The ds4 engine copies tool schemas (and some other values) into the prompt byte for byte, so the
renderer needs the bytes the client sent, not vLLM's pydantic models (which re-serialize them).
vLLM's renderer API only receives parsed messages, so the bytes travel beside it:

1. `RawRequestBodyMiddleware` (installed with `vllm serve --middleware`, which ds4-vllm adds to
   the command line, see `ds4_vllm.serving.startup`) is a pure ASGI middleware. For a POST to a
   route in `ROUTES` it reads the whole body, stores it in the context variable `RAW_REQUEST`
   and hands the same bytes on to vLLM.
2. FastAPI runs the route handler in the middleware's task, and everything vLLM awaits from it
   (asyncio tasks, BaseHTTPMiddleware task groups) gets a copy of that context, so
   `current_raw_request()` inside `Ds4Renderer.render_messages_async` sees exactly the body of
   the request being rendered, with no shared table and no request-id matching. Concurrent
   requests each have their own context. The renderer reads it in its async method, before it
   hands work to a thread (threads do not inherit context variables).

Other ds4 components may read `current_raw_request()` too (e.g. to validate tool-call ids).
"""

from __future__ import annotations

import contextvars
import dataclasses
import enum
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Route(enum.Enum):
    """Which ds4 request parser a body is for (the engine has one per API)."""

    CHAT = "chat"
    COMPLETION = "completion"
    RESPONSES = "responses"
    ANTHROPIC = "anthropic"


#: Paths whose body the renderer reads, and how. The render and count endpoints render the same
#: request as the route they belong to; /tokenize takes a chat body when it has `messages`.
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": Route.CHAT,
    "/v1/chat/completions/render": Route.CHAT,
    "/tokenize": Route.CHAT,
    "/v1/completions": Route.COMPLETION,
    "/v1/completions/render": Route.COMPLETION,
    "/v1/responses": Route.RESPONSES,
    "/v1/responses/render": Route.RESPONSES,
    "/v1/messages": Route.ANTHROPIC,
    "/v1/messages/render": Route.ANTHROPIC,
    "/v1/messages/count_tokens": Route.ANTHROPIC,
}


@dataclasses.dataclass(frozen=True, slots=True)
class RawRequest:
    """One HTTP request's route and exact body bytes."""

    route: Route
    path: str
    body: bytes


RAW_REQUEST: contextvars.ContextVar[RawRequest | None] = contextvars.ContextVar(
    "ds4_raw_request", default=None
)


def current_raw_request() -> RawRequest | None:
    """The raw body of the HTTP request being handled in this context, if the middleware saw one."""
    return RAW_REQUEST.get()


def post_path(scope: Scope) -> str | None:
    """The path of an HTTP POST without the app's root_path and trailing slash; None otherwise."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


def route_for(scope: Scope) -> Route | None:
    """The ds4 route of an ASGI scope (POST only; the app's root_path is not part of the route)."""
    path = post_path(scope)
    return None if path is None else ROUTES.get(path)


async def read_body(receive: Receive) -> bytes:
    """All `http.request` chunks of a request body."""
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":  # a disconnect before the body was complete
            return b"".join(chunks)
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


class RawRequestBodyMiddleware:
    """ASGI middleware: keeps the raw body of ds4-rendered routes in `RAW_REQUEST` (see module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_for(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        replayed = False

        async def receive_again() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as before

        token = RAW_REQUEST.set(RawRequest(route, scope.get("path", ""), body))
        try:
            await self.app(scope, receive_again, send)
        finally:
            RAW_REQUEST.reset(token)
