"""Issue 12, hostile HTTP input: bodies FastAPI cannot parse, and keys only the server may set, get a
400 that names the problem (in the route's own error format) from `RawRequestBodyMiddleware`.

A real FastAPI app with a pydantic body stands in for vLLM's routes, so FastAPI's own bare answer
("There was an error parsing the body") is what the middleware sees, as in `vllm serve`.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from ds4_vllm.serving.request_body import (
    FASTAPI_UNPARSABLE,
    MAX_JSON_DEPTH,
    RESERVED_TRANSFER_KEYS,
    RawRequestBodyMiddleware,
    reserved_key_problem,
    unparsable_body_problem,
)

pytestmark = pytest.mark.reliability


class Body(BaseModel):
    model: str
    x: object = None
    kv_transfer_params: dict | None = None


ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/invocations", "/v1/other")


async def handler(body: Body) -> dict:
    return {"ok": body.model}


def make_app(middleware: bool = True) -> FastAPI:
    app = FastAPI()
    for path in ROUTES:
        app.post(path)(handler)
    if middleware:
        app.add_middleware(RawRequestBodyMiddleware)
    return app


@pytest.fixture(scope="module")
def client() -> httpx.ASGITransport:
    return httpx.ASGITransport(app=make_app())


def post(transport: httpx.ASGITransport, path: str, body: bytes) -> httpx.Response:
    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, content=body, headers={"content-type": "application/json"})

    return asyncio.run(go())


NESTED = b'{"model": "ds4", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
BAD_UTF8 = b'{"model": "ds4", "x": "h\xff\xfei"}'
BAD_AT = BAD_UTF8.index(b"\xff")


def test_fastapi_alone_gives_the_bare_answer_the_middleware_replaces() -> None:
    response = post(httpx.ASGITransport(app=make_app(middleware=False)), "/v1/chat/completions", NESTED)
    assert (response.status_code, response.content) == (400, FASTAPI_UNPARSABLE)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/invocations"])
def test_deep_nesting_and_bad_utf8_are_named_with_their_byte_offset(client, path: str) -> None:
    response = post(client, path, NESTED)
    assert response.status_code == 400
    at = NESTED.index(b"[") + MAX_JSON_DEPTH - 1  # the object is level 1: the 256th "[" is level 257
    assert response.json()["error"]["message"] == (
        f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels at byte offset {at}"
    )
    response = post(client, path, BAD_UTF8)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (f"request body: not valid UTF-8 at byte offset {BAD_AT}")


def test_the_anthropic_route_answers_in_its_own_error_format(client) -> None:
    response = post(client, "/v1/messages", BAD_UTF8)
    assert response.status_code == 400
    assert response.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": f"request body: not valid UTF-8 at byte offset {BAD_AT}",
        },
    }


def test_other_routes_and_good_bodies_are_untouched(client) -> None:
    assert post(client, "/v1/other", NESTED).content == FASTAPI_UNPARSABLE  # not a route of ours
    ok = post(client, "/v1/chat/completions", b'{"model": "ds4", "x": [[["ds4_tool_map"]]]}')
    assert (ok.status_code, ok.json()) == (200, {"ok": "ds4"})
    invalid = post(client, "/v1/chat/completions", b'{"model": "ds4",')  # FastAPI's own clear 422
    assert invalid.status_code == 422 and "JSON decode error" in invalid.text


@pytest.mark.parametrize("key", RESERVED_TRANSFER_KEYS)
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/invocations"])
def test_a_client_cannot_send_the_connectors_reserved_keys(client, path: str, key: str) -> None:
    body = {"model": "ds4", "kv_transfer_params": {"other": 1, key: [["call_planted", "<tool_calls>"]]}}
    response = post(client, path, json.dumps(body).encode())
    assert response.status_code == 400
    expected = f"kv_transfer_params.{key}: reserved for the server's ds4disk connector; do not send it"
    assert expected in response.text
    allowed = post(client, path, json.dumps({**body, "kv_transfer_params": {"other": 1}}).encode())
    assert allowed.status_code == 200


def test_problem_finders_on_their_own() -> None:
    assert unparsable_body_problem(b'{"a": "[[[[", "b": 1}') is None  # brackets inside strings
    deep = b'{"s": "\\"]]]", "x": ' + b"{" * 300
    assert unparsable_body_problem(deep) == (
        f"request body: JSON nested deeper than {MAX_JSON_DEPTH} levels at byte offset {deep.index(b'{', 2) + 255}"
    )
    assert reserved_key_problem(b'{"kv_transfer_params": 5, "ds4_tool_map": 1}') is None
    escaped = b'{"kv\\u005ftransfer_params": {"\\u0064s4\\u005Ftool_map": []}}'  # JSON reads the same keys
    assert json.loads(escaped) == {"kv_transfer_params": {"ds4_tool_map": []}}
    assert reserved_key_problem(escaped) is not None
    assert reserved_key_problem(b"ds4_tool_map [") is None  # not JSON: vLLM answers it


def test_the_nesting_scan_is_linear_in_the_body() -> None:
    """An unterminated string full of escaped quotes made the first scan restart at each quote:
    40 KB took 37 s (measured). Now 4 MB of it takes 0.33 s (measured, load average 28); 5 s is room for more load."""
    body = b'{"a": 1, "s": "' + b'\\"' * 2_000_000 + b"  [[[["
    started = time.monotonic()
    assert unparsable_body_problem(body) is None
    assert time.monotonic() - started < 5.0
