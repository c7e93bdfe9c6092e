"""The usage middleware at the ASGI level: a fake vLLM app that calls a fake engine's `generate`."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from ds4_vllm.contracts import DISK_TOKENS_PARAM
from ds4_vllm.serving.middleware import Ds4UsageMiddleware
from ds4_vllm.serving.request_outputs import record_outputs, recording
from ds4_vllm.serving.state import ServingState
from ds4_vllm.serving.usage_counters import UsageCounters, UsageTotals

PROMPT = list(range(604))


def output(finished: bool, cached: int = 603, disk: int = 91):
    return SimpleNamespace(
        prompt_token_ids=PROMPT,
        num_cached_tokens=cached,
        finished=finished,
        kv_transfer_params={DISK_TOKENS_PARAM: disk} if finished else None,
    )


async def fake_generate(outputs, closed: list[str]):
    try:
        for out in outputs:
            yield out
    finally:
        closed.append("closed")


def make_app(chunks_of, status: int = 200, content_type: bytes = b"application/json", outputs=None):
    """A vLLM stand-in: runs `generate`, then sends the body chunks `chunks_of(outputs)` builds."""
    generate = record_outputs(fake_generate)

    async def app(scope, receive, send):
        seen = [out async for out in generate(outputs or [output(False), output(True)], [])]
        body = chunks_of(seen)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(sum(map(len, body))).encode()),
                ],
            }
        )
        for i, chunk in enumerate(body):
            await send({"type": "http.response.body", "body": chunk, "more_body": i < len(body) - 1})

    return app


def call(app, path: str, architectures=("Ds4ForCausalLM",)):
    counters = UsageCounters(None)
    # vLLM's app state: the engine client, whose renderer is the ds4 one (with the state) for a ds4 model
    renderer = SimpleNamespace()
    if "Ds4ForCausalLM" in architectures:
        renderer.serving = ServingState(counters=counters)
    state = SimpleNamespace(engine_client=SimpleNamespace(renderer=renderer))
    scope = {"type": "http", "method": "POST", "path": path, "app": SimpleNamespace(state=state)}
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    asyncio.run(Ds4UsageMiddleware(app)(scope, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent, body, counters.totals()


CHAT_JSON = {
    "id": "chatcmpl-1",
    "usage": {
        "prompt_tokens": 604,
        "completion_tokens": 4,
        "total_tokens": 608,
        "prompt_tokens_details": None,
    },
    "kv_transfer_params": {DISK_TOKENS_PARAM: 91},
}


def test_json_response_gets_the_fields_and_a_new_length() -> None:
    sent, body, totals = call(make_app(lambda _: [json.dumps(CHAT_JSON).encode()]), "/v1/chat/completions")
    obj = json.loads(body)
    assert obj["usage"]["prompt_tokens_details"] == {"cached_tokens": 603, "cache_write_tokens": 1}
    assert (obj["usage"]["prompt_cache_hit_tokens"], obj["usage"]["prompt_cache_miss_tokens"]) == (603, 1)
    assert obj["usage"]["prompt_cache_disk_tokens"] == 91
    assert obj["kv_transfer_params"] is None  # the connector's report is internal
    headers = dict(sent[0]["headers"])
    assert int(headers[b"content-length"]) == len(body)
    assert totals == UsageTotals(requests=1, prompt_tokens=604, hit_tokens=603, miss_tokens=1, disk_tokens=91)


def sse(*events: dict | str) -> bytes:
    return b"".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode() for e in events)


def test_sse_events_split_across_chunks_are_rewritten_and_others_kept_byte_for_byte() -> None:
    token_event = {"choices": [{"delta": {"content": "héllo"}}], "weird spacing": 1}
    final = {"choices": [], "usage": {"prompt_tokens": 604, "completion_tokens": 1, "total_tokens": 605}}
    stream = sse(token_event, final, "[DONE]")
    cut = stream.index(b'"usage"') + 3  # a chunk boundary inside the usage event

    _, body, totals = call(
        make_app(lambda _: [stream[:10], stream[10:cut], stream[cut:]], content_type=b"text/event-stream"),
        "/v1/chat/completions",
    )
    events = body.split(b"\n\n")
    assert events[0] + b"\n\n" == sse(token_event)
    usage = json.loads(events[1].removeprefix(b"data: "))["usage"]
    assert (
        usage["prompt_cache_hit_tokens"],
        usage["prompt_cache_miss_tokens"],
        usage["prompt_cache_disk_tokens"],
    ) == (
        603,
        1,
        91,
    )
    assert events[2:] == [b"data: [DONE]", b""]
    assert totals.requests == 1 and totals.hit_tokens == 603


def test_stream_without_usage_is_still_counted() -> None:
    stream = sse({"choices": [{"delta": {"content": "x"}}]}, "[DONE]")
    _, body, totals = call(make_app(lambda _: [stream], content_type=b"text/event-stream"), "/v1/completions")
    assert body == stream
    assert totals == UsageTotals(1, 604, 603, 1, 91)


def test_anthropic_message_start_has_no_disk_count_until_the_end() -> None:
    """message_start is sent after the first output: R is known, the disk count is not yet."""

    def chunks(_):
        return [
            b"event: message_start\n"
            + sse({"type": "message_start", "message": {"usage": {"input_tokens": 604, "output_tokens": 0}}})
        ]

    _, body, _ = call(
        make_app(chunks, content_type=b"text/event-stream", outputs=[output(False)]), "/v1/messages"
    )
    usage = json.loads(body.split(b"data: ")[1])["message"]["usage"]
    assert usage == {
        "input_tokens": 0,
        "output_tokens": 0,
        "cache_read_input_tokens": 603,
        "cache_creation_input_tokens": 1,
        "prompt_cache_hit_tokens": 603,
        "prompt_cache_miss_tokens": 1,
    }


def test_responses_event_loses_the_internal_params() -> None:
    event = {
        "type": "response.completed",
        "response": {
            "usage": {"input_tokens": 604, "output_tokens": 4},
            "kv_transfer_params": {DISK_TOKENS_PARAM: 91},
        },
    }
    _, body, _ = call(make_app(lambda _: [sse(event)], content_type=b"text/event-stream"), "/v1/responses")
    response = json.loads(body.removeprefix(b"data: "))["response"]
    assert response["kv_transfer_params"] is None
    assert response["usage"]["input_tokens_details"] == {"cached_tokens": 603, "cache_write_tokens": 1}


@pytest.mark.parametrize(
    ("path", "status", "architectures"),
    [
        ("/v1/chat/completions", 400, ("Ds4ForCausalLM",)),  # errors pass through
        ("/v1/models", 200, ("Ds4ForCausalLM",)),  # not a generation route
        ("/v1/chat/completions", 200, ("LlamaForCausalLM",)),  # not a ds4 model
    ],
)
def test_other_responses_pass_through_untouched(path, status, architectures) -> None:
    original = json.dumps(CHAT_JSON).encode()
    _, body, totals = call(make_app(lambda _: [original], status=status), path, architectures)
    assert body == original
    assert totals.requests == 0


def test_recorder_ties_outputs_to_the_http_request_and_closing_reaches_vllm() -> None:
    closed: list[str] = []
    generate = record_outputs(fake_generate)

    async def run():
        with recording() as recorder:
            stream = generate([output(False), output(True)], closed)
            first = await stream.__anext__()
            assert first.finished is False
            assert recorder.counts().disk_tokens is None  # not finished yet
            await stream.aclose()  # the client went away: vLLM's generator must close (abort) now
            return recorder.counts()

    counts = asyncio.run(run())
    assert closed == ["closed"]
    assert (counts.prompt_tokens, counts.cached_tokens) == (604, 603)
