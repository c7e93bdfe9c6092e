"""ASGI middleware that puts ds4's cache usage on every generation response (`vllm serve --middleware`).

vLLM has no hook for the usage object of a response, so this middleware rewrites the bytes:
for `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses` and `/v1/messages` with a
ds4 model, every usage object in a JSON body or an SSE event gets the fields of
`ds4_vllm.serving.usage` (computed from what the engine reported for this HTTP request, see
`ds4_vllm.serving.request_outputs`), and the connector's internal `kv_transfer_params` key is
removed. Every finished generation response is also added to the server's cumulative counters
(`ServingState.record_usage`, reported by `GET /v1/kv_cache`). Other routes, error responses and
other models (no ds4 serving state) pass through untouched; SSE events without usage keep their
exact bytes.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ds4_vllm.contracts import DISK_TOKENS_PARAM
from ds4_vllm.serving.request_body import header_value, post_path
from ds4_vllm.serving.request_outputs import RequestRecorder, recording
from ds4_vllm.serving.state import serving_state_of_app
from ds4_vllm.serving.usage import USAGE_REWRITES, CacheUsage, EngineCounts

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
UsageRewrite = Callable[[dict[str, Any], EngineCounts | None], tuple[dict[str, Any], CacheUsage]]

#: An SSE event that may carry a usage object (a quick byte test before parsing any JSON).
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
_EVENT_END = re.compile(rb"\r?\n\r?\n")
#: Where the routes put usage objects: the top level (chat, completions, Anthropic message and
#: message_delta), `response` (Responses events), `message` (Anthropic message_start).
_USAGE_PARENTS = (None, "response", "message")


class Ds4UsageMiddleware:
    """Rewrites usage in the responses of the four generation routes; see the module docstring."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        rewrite = _usage_rewrite(scope)
        state = serving_state_of_app(scope["app"].state) if rewrite is not None and "app" in scope else None
        if rewrite is None or state is None:
            await self.app(scope, receive, send)
            return
        with recording() as recorder:
            response = UsageResponse(send, rewrite, recorder, state.record_usage)
            await self.app(scope, receive, response.send)


class Ds4Middleware:
    """The one `--middleware` a ds4 server gets: error shapes, usage rewriting, the raw-body keeper.

    One entry, not three: vLLM's argument parser warns "Found duplicate keys --middleware" when
    the flag repeats. Outermost first: error bodies are reshaped last (`error_shapes`), after
    every inner layer, including the raw-body keeper's own 400s, has answered.
    """

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        from ds4_vllm.serving.error_shapes import ErrorShapeMiddleware
        from ds4_vllm.serving.request_body import RawRequestBodyMiddleware

        self.app = ErrorShapeMiddleware(Ds4UsageMiddleware(RawRequestBodyMiddleware(app)))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


def _usage_rewrite(scope: Scope) -> UsageRewrite | None:
    path = post_path(scope)
    return None if path is None else USAGE_REWRITES.get(path)


class UsageResponse:
    """The `send` side of one generation request: rewrites usage, then reports the final one.

    A JSON body is held until complete (its length changes); an SSE stream is passed on event
    by event. `on_finished` gets the response's cache usage once, before its last bytes leave.
    """

    def __init__(
        self,
        send: Send,
        rewrite: UsageRewrite,
        recorder: RequestRecorder,
        on_finished: Callable[[CacheUsage], None],
    ) -> None:
        self._send = send
        self._rewrite = rewrite
        self._recorder = recorder
        self._on_finished = on_finished
        self._mode = "pass"
        self._start: Message | None = None
        self._buffer = b""
        self._last_usage: CacheUsage | None = None

    async def send(self, message: Message) -> None:
        kind = message.get("type")
        if kind == "http.response.start":
            await self._start_response(message)
        elif kind == "http.response.body" and self._mode != "pass":
            await self._body(message)
        else:
            await self._send(message)

    async def _start_response(self, message: Message) -> None:
        content_type = header_value(message, b"content-type")
        if message.get("status") != 200:
            self._mode = "pass"
        elif content_type.startswith(b"application/json"):
            self._mode, self._start = "json", message
            return  # sent with the body, whose length changes
        elif content_type.startswith(b"text/event-stream"):
            self._mode = "sse"
        await self._send(message)

    async def _body(self, message: Message) -> None:
        self._buffer += message.get("body", b"")
        more = message.get("more_body", False)
        if self._mode == "json":
            if more:
                return
            body = self._rewrite_json(self._buffer)
            self._finish()
            assert self._start is not None
            start = dict(self._start)
            start["headers"] = [
                (k, str(len(body)).encode() if k.lower() == b"content-length" else v)
                for k, v in self._start.get("headers", [])
            ]
            await self._send(start)
            await self._send({"type": "http.response.body", "body": body, "more_body": False})
            return
        out = []
        while (match := _EVENT_END.search(self._buffer)) is not None:
            event, self._buffer = self._buffer[: match.end()], self._buffer[match.end() :]
            out.append(self._rewrite_event(event))
        if not more:
            out.append(self._buffer)
            self._buffer = b""
            self._finish()
        if out or not more:
            await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    def _rewrite_json(self, body: bytes) -> bytes:
        try:
            obj = json.loads(body)
        except ValueError:
            return body
        if not isinstance(obj, dict):
            return body
        rewritten = self._rewrite_usages(obj)
        if not (_drop_internal_params(obj) or rewritten):
            return body
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    def _rewrite_event(self, event: bytes) -> bytes:
        """One SSE event (`event: ...` and `data: {...}` lines); unchanged unless it holds usage."""
        if not _USAGE_OBJECT.search(event):
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data:"):
                continue
            raw = line[5:].strip()
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if isinstance(obj, dict) and (self._rewrite_usages(obj) | _drop_internal_params(obj)):
                lines[i] = b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
                lines[i] += b"\r" if line.endswith(b"\r") else b""
        return b"\n".join(lines)

    def _rewrite_usages(self, obj: dict[str, Any]) -> bool:
        changed = False
        engine = self._recorder.counts()
        for parent_key in _USAGE_PARENTS:
            parent = obj if parent_key is None else obj.get(parent_key)
            usage = parent.get("usage") if isinstance(parent, dict) else None
            if isinstance(usage, dict):
                parent["usage"], self._last_usage = self._rewrite(usage, engine)
                changed = True
        return changed

    def _finish(self) -> None:
        """Count the response once: its last usage object, else what the engine reported."""
        cache = self._last_usage
        if cache is None:
            engine = self._recorder.counts()
            if engine is None:
                return
            cache = CacheUsage.of(engine.prompt_tokens, engine.cached_tokens, engine.disk_tokens)
        try:
            self._on_finished(cache)
        except Exception:  # counters are statistics: never fail the response for them
            logger.exception("ds4 usage counters: could not record a response")


def _drop_internal_params(obj: dict[str, Any]) -> bool:
    """The connector's per-request report is internal: remove it (and an emptied field).

    It sits at the top level, or in `response` (Responses events); True when removed.
    """
    removed = False
    for holder in (obj, obj.get("response")):
        params = holder.get("kv_transfer_params") if isinstance(holder, dict) else None
        if isinstance(params, dict) and DISK_TOKENS_PARAM in params:
            rest = {k: v for k, v in params.items() if k != DISK_TOKENS_PARAM}
            holder["kv_transfer_params"] = rest or None
            removed = True
    return removed
