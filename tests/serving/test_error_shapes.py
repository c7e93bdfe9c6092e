"""Error bodies in each API's own shape (`ds4_vllm.serving.error_shapes`, issue 20).

The inputs are vLLM 0.32's own error bodies, copied from a live `ds4-vllm serve` (2026-12-05);
tests/serving/test_serve_render.py checks the same through the SDKs against a real server.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from ds4_vllm.serving.error_shapes import (
    ErrorShapeMiddleware,
    anthropic_error,
    context_overflow,
    openai_error,
)

TOO_LONG = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt contains 3005 "
        "input tokens, which exceeds this limit even without any output tokens. Please reduce the length "
        "of the input prompt. (parameter=input_tokens, value=3005)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}
MISSING_FIELD = {
    "error": {
        "message": "1 validation error:\n  {'type': 'missing', 'loc': 'body.max_tokens', 'msg': 'Field required'}",
        "type": "Bad Request",
        "param": "body.max_tokens",
        "code": 400,
    }
}
NO_MODEL = {
    "type": "error",
    "error": {"type": "NotFoundError", "message": "The model `nope` does not exist."},
}


def test_a_prompt_over_the_context_reads_as_anthropic_words_it() -> None:
    assert context_overflow(TOO_LONG["error"]["message"]) == (3005, 2048)
    assert anthropic_error(400, TOO_LONG) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 3005 tokens > 2048 maximum",
        },
    }


@pytest.mark.parametrize(
    ("status", "body", "kind"),
    [
        (400, MISSING_FIELD, "invalid_request_error"),
        (404, NO_MODEL, "not_found_error"),
        (500, {}, "api_error"),
    ],
)
def test_every_error_gets_anthropics_type_for_its_status(status: int, body: dict, kind: str) -> None:
    shaped = anthropic_error(status, body)
    assert shaped["type"] == "error" and shaped["error"]["type"] == kind
    if body:
        assert shaped["error"]["message"] == body["error"]["message"]


def test_openai_routes_get_context_length_exceeded_and_other_errors_stay() -> None:
    shaped = openai_error("/v1/chat/completions", TOO_LONG)
    assert shaped is not None
    assert shaped["error"] == {
        "message": TOO_LONG["error"]["message"],
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert openai_error("/v1/responses", TOO_LONG)["error"]["param"] == "input"  # type: ignore[index]
    assert openai_error("/v1/chat/completions", MISSING_FIELD) is None


def run_app(
    path: str, status: int, body: bytes, content_type: bytes = b"application/json"
) -> tuple[int, bytes]:
    async def app(scope, receive, send):
        headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body[:5], "more_body": True})
        await send({"type": "http.response.body", "body": body[5:], "more_body": False})

    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
    asyncio.run(ErrorShapeMiddleware(app)(scope, receive, send))
    out = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    length = dict(sent[0]["headers"])[b"content-length"]
    assert int(length) == len(out)  # the header follows the new body
    return sent[0]["status"], out


def test_the_middleware_reshapes_error_bodies_and_passes_everything_else() -> None:
    status, body = run_app("/v1/messages", 400, json.dumps(TOO_LONG).encode())
    assert (
        status == 400
        and json.loads(body)["error"]["message"] == "prompt is too long: 3005 tokens > 2048 maximum"
    )
    ok = b'{"id": "msg_1", "type": "message"}'
    assert run_app("/v1/messages", 200, ok) == (200, ok)
    assert run_app("/v1/models", 400, json.dumps(TOO_LONG).encode())[1] == json.dumps(TOO_LONG).encode()
    assert run_app("/v1/messages", 500, b"Internal Server Error", b"text/plain") == (
        500,
        b"Internal Server Error",
    )
