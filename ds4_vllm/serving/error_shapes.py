"""Error bodies in the shape each API's clients read (`Ds4Middleware`, issue 20).

vLLM answers `/v1/messages` validation errors in OpenAI's shape and its other errors with
Python exception names as types (`BadRequestError`, `NotFoundError`); Anthropic clients decide
from `{"type": "error", "error": {"type": "invalid_request_error", ...}}` and compact a
conversation when the message says `prompt is too long: N tokens > M maximum`. OpenAI clients
look for the code `context_length_exceeded`. This rewrites error responses (status >= 400, JSON)
of the generation routes into those shapes and leaves every other response untouched.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ds4_vllm.serving.request_body import header_value, post_path

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
#: The OpenAI routes and the request field a too-long prompt is in (OpenAI's `param`).
OPENAI_PROMPT_PARAM = {
    "/v1/chat/completions": "messages",
    "/v1/completions": "prompt",
    "/v1/responses": "input",
}

#: Anthropic's error types by HTTP status (docs.anthropic.com, "Errors").
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    529: "overloaded_error",
}

#: vLLM's too-long-prompt message (`vllm.renderers.params`): the limit, then the prompt's size.
_CONTEXT_LIMIT = re.compile(r"maximum context length is (\d+) tokens")
_PROMPT_TOKENS = re.compile(r"\(parameter=input_tokens, value=(\d+)\)")
_PROMPT_CHARS = re.compile(r"\(parameter=input_text, value=\d+\)")


def context_overflow(message: str) -> tuple[int | None, int] | None:
    """(prompt tokens or None when vLLM counted characters, the limit) of a too-long-prompt error."""
    limit = _CONTEXT_LIMIT.search(message)
    if limit is None:
        return None
    tokens = _PROMPT_TOKENS.search(message)
    if tokens is not None:
        return int(tokens.group(1)), int(limit.group(1))
    if _PROMPT_CHARS.search(message):
        return None, int(limit.group(1))
    return None


def _message_of(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"]  # Starlette's own HTTPException body
    return json.dumps(body, ensure_ascii=False)


def anthropic_error(status: int, body: Any) -> dict[str, Any]:
    """The Anthropic error body for a vLLM error response of this status."""
    message = _message_of(body)
    overflow = context_overflow(message)
    if overflow is not None:
        tokens, limit = overflow
        # Anthropic's wording, which clients match to compact the conversation.
        size = f"{tokens} tokens" if tokens is not None else "more tokens"
        message = f"prompt is too long: {size} > {limit} maximum"
    kind = ANTHROPIC_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def openai_error(path: str, body: Any) -> dict[str, Any] | None:
    """The body with OpenAI's `context_length_exceeded` code when it is that error; else None."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or context_overflow(_message_of(body)) is None:
        return None
    error = {**error, "type": "invalid_request_error", "param": OPENAI_PROMPT_PARAM[path]}
    error["code"] = "context_length_exceeded"
    return {**body, "error": error}


class ErrorShapeMiddleware:
    """Rewrites JSON error responses of the generation routes; see the module docstring."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = post_path(scope)
        if path not in ANTHROPIC_ROUTES and path not in OPENAI_PROMPT_PARAM:
            await self.app(scope, receive, send)
            return
        await self.app(scope, receive, _ErrorResponse(send, path).send)


class _ErrorResponse:
    """The `send` side of one request: holds a JSON error body until complete, then reshapes it."""

    def __init__(self, send: Send, path: str) -> None:
        self._send = send
        self._path = path
        self._start: Message | None = None
        self._buffer = b""

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            if message.get("status", 200) >= 400 and header_value(message, b"content-type").startswith(
                b"application/json"
            ):
                self._start = message
                return
        elif kind == "http.response.body" and self._start is not None:
            self._buffer += message.get("body", b"")
            if message.get("more_body", False):
                return
            await self._send_reshaped()
            return
        await self._send(message)

    async def _send_reshaped(self) -> None:
        assert self._start is not None
        status = int(self._start["status"])
        body = self._buffer
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if parsed is not None:
            if self._path in ANTHROPIC_ROUTES:
                shaped: dict[str, Any] | None = anthropic_error(status, parsed)
            else:
                shaped = openai_error(self._path, parsed)
            if shaped is not None:
                body = json.dumps(shaped, ensure_ascii=False, separators=(",", ":")).encode()
        headers = [
            (k, str(len(body)).encode() if k.lower() == b"content-length" else v)
            for k, v in self._start.get("headers", [])
        ]
        await self._send({**self._start, "headers": headers})
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
