"""The client's raw request body, captured before pydantic parses it, for the ds4 renderer.

The ds4 engine copies tool schemas (and some other values) into the prompt byte for byte, so the
renderer needs the bytes the client sent, not vLLM's pydantic models (which re-serialize them).
vLLM's renderer API only receives parsed messages, so the bytes travel beside it:

`RawRequestBodyMiddleware` (installed with `vllm serve --middleware`, which ds4-vllm adds to the
command line, see `ds4_vllm.serving.startup`) is a pure ASGI middleware. For a POST to a route in
`ROUTES` it reads the whole body, keeps it as the request's `raw` (`current_request().raw`, the
request's context, `ds4_vllm.serving.request_context`) and hands the same bytes on to vLLM; the
renderer reads it there (`Ds4Renderer.render_messages_async`).

The middleware also answers two kinds of bad request itself, with a 400 naming the problem:

- a body whose `kv_transfer_params` holds the keys this server sets for the ds4disk connector
  (`RESERVED_TRANSFER_KEYS`): on /v1/completions nothing would replace them, and a client could
  write tool-call ids of its choosing into checkpoint trailers, or choose its own id seed;
- a body FastAPI cannot parse at all (invalid UTF-8, JSON nested past Python's recursion limit),
  which FastAPI answers with a bare "There was an error parsing the body": the answer is replaced
  with what is wrong and at which byte offset (`unparsable_body_problem`), only on that path.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ds4_vllm.contracts import RESERVED_TRANSFER_KEYS
from ds4_vllm.serving.request_context import PromptFacts, serving_request

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


#: Other POST routes that take a generation request (vLLM's SageMaker and batch routes): only the
#: reserved keys are checked there, the body is not kept.
CHECKED_ROUTES = frozenset({"/invocations", "/v1/chat/completions/batch"})

#: The engine's JSON_MAX_NESTING (`ds4_vllm.chat.json_text`), named when a body nests deeper.
MAX_JSON_DEPTH = 256
#: FastAPI's answer to a body `json.loads` raises other than JSONDecodeError on.
FASTAPI_UNPARSABLE = b'{"detail":"There was an error parsing the body"}'
#: A string (an unterminated one runs to the end: one linear pass, never a rescan from each escaped
#: quote inside it), or a bracket.
_JSON_STRUCTURE = re.compile(rb'"(?:[^"\\]|\\.)*+"?|[\[\]{}]', re.DOTALL)


@dataclasses.dataclass(frozen=True, slots=True)
class RawRequest:
    """One HTTP request's route and exact body bytes."""

    route: Route
    path: str
    body: bytes


def post_path(scope: Scope) -> str | None:
    """The path of an HTTP POST without the app's root_path and trailing slash; None otherwise."""
    if scope.get("type") != "http" or scope.get("method") != "POST":
        return None
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path.rstrip("/") or "/"


def header_value(message: Message, name: bytes) -> bytes:
    """A response header of an ASGI `http.response.start` message, lower-cased; b"" if absent."""
    for key, value in message.get("headers", []):
        if key.lower() == name:
            return value.lower()
    return b""


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


def reserved_key_problem(body: bytes) -> str | None:
    """What is wrong when a client sends a `kv_transfer_params` key only the server may set."""
    if b"ds4_" not in body and b"\\u00" not in body:
        return None  # one or two byte searches; "\u00XX" could spell the key's ASCII letters
    try:
        parsed = json.loads(body)
    except (ValueError, RecursionError):
        return None  # vLLM answers a body that is not JSON
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    if not isinstance(params, dict):
        return None
    for key in RESERVED_TRANSFER_KEYS:
        if key in params:
            return f"kv_transfer_params.{key}: reserved for the server's ds4disk connector; do not send it"
    return None


def unparsable_body_problem(body: bytes) -> str | None:
    """Why `json.loads` cannot read a body it did not call malformed: invalid UTF-8, or nesting."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"request body: not valid UTF-8 at byte offset {exc.start}"
    depth = 0
    for match in _JSON_STRUCTURE.finditer(body):
        c = match.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                return f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels at byte offset {match.start()}"
        elif c in (b"]", b"}"):
            depth -= 1
    return None


def error_body(route: Route | None, message: str) -> bytes:
    """A 400 body in the route's own error format (Anthropic's, or OpenAI's)."""
    if route is Route.ANTHROPIC:
        error: dict[str, Any] = {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": message},
        }
    else:
        error = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}}
    return json.dumps(error).encode()


async def send_bad_request(send: Send, route: Route | None, message: str) -> None:
    body = error_body(route, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 400, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def clear_parse_errors(send: Send, route: Route | None, body: bytes) -> Send:
    """`send`, with FastAPI's bare "error parsing the body" 400 replaced by what is wrong."""
    held: Message | None = None

    async def send_clear(message: Message) -> None:
        nonlocal held
        if message["type"] == "http.response.start" and message.get("status") == 400:
            held = message  # wait for the body to know whether it is FastAPI's bare answer
            return
        if held is not None and message["type"] == "http.response.body":
            start, held = held, None
            bare = message.get("body", b"") == FASTAPI_UNPARSABLE and not message.get("more_body", False)
            problem = unparsable_body_problem(body) if bare else None
            if problem is not None:
                await send_bad_request(send, route, problem)
                return
            await send(start)
        await send(message)

    return send_clear


class RawRequestBodyMiddleware:
    """ASGI middleware: keeps the raw body of ds4-rendered routes as the request's `raw` (see module doc)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = route_for(scope)
        if route is None and post_path(scope) not in CHECKED_ROUTES:
            await self.app(scope, receive, send)
            return
        body = await read_body(receive)
        problem = reserved_key_problem(body)
        if problem is not None:
            await send_bad_request(send, route, problem)
            return
        send = clear_parse_errors(send, route, body)
        replayed = False

        async def receive_again() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for the disconnect, as before

        if route is None:  # a checked-only route: the body is not rendered by ds4
            await self.app(scope, receive_again, send)
            return
        with serving_request(raw=RawRequest(route, scope.get("path", ""), body), prompt=PromptFacts()):
            await self.app(scope, receive_again, send)
