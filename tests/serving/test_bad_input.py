"""Issue 9, bad input: a real `vllm serve --model ds4 --kv-connector ds4disk` answers bad requests with a
4xx naming the problem, and a normal request afterwards still gets the same answer and its cache hits.

One server (`--tool-memory-max-ids 2`) sees, in order: a probe prompt (cold, then warm); the bad
requests (malformed tool-call JSON, a tool result answering no call, invalid `stream_options`,
tool schemas that are not JSON objects or not JSON at all); a conversation with three sampled tool
calls, one more than the tool memory holds, sent back whole; a call id that differs from a
remembered one by one character; and the probe prompt again.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from ds4_vllm.chat.render import render_chat_completion
from ds4_vllm.chat.tokenizer import default_tokenizer
from tests.e2e.server_process import ServerProcess
from tests.serving.forced_dsml import forced

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 4096
TOOL_MEMORY_MAX_IDS = 2
#: vLLM's prefix-cache block for the ds4 model (its log: "kv lcm block sizes 256").
BLOCK = 256
P_CLOSE = "</｜DSML｜parameter>"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["path"],
            },
        },
    }
]
NO_THINKING = {"chat_template_kwargs": {"thinking": False}}
PROBE = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": " ".join(f"probe{i}" for i in range(300))},
]
TOOL_TALK = [
    {"role": "system", "content": "You are a coding agent."},
    {"role": "user", "content": "Read three files."},
]


def sampled_block(n: int) -> str:
    """Call n's DSML: two spaces in the invoke tag, `limit` first with spaces around it."""
    return (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke  name="read_file">\n'
        f'<｜DSML｜parameter name="limit" string="false"> {n}0 {P_CLOSE}\n'
        f'<｜DSML｜parameter name="path" string="true">file_{n}.txt{P_CLOSE}\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )


def assistant_call(call_id: str, arguments: str) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "read_file", "arguments": arguments}}
        ],
    }


def post(server: ServerProcess, body: dict | bytes, path: str = "/v1/chat/completions") -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.base_url}{path}", content=content, headers={"content-type": "application/json"}, timeout=300
    )


def ask_probe(server: ServerProcess) -> dict:
    response = post(
        server, {"model": "ds4", "messages": PROBE, "max_tokens": 8, "temperature": 0, **NO_THINKING}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    return {"content": body["choices"][0]["message"]["content"], **body["usage"]}


def error_of(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["message"]


def bad_requests() -> dict[str, tuple[dict | bytes, str]]:
    """name -> (request body, path)."""
    base = {"model": "ds4", "max_tokens": 2, "tools": TOOLS}
    user = {"role": "user", "content": "hi"}
    bad_args = [
        user,
        assistant_call("call_a", '{"path": "x",'),
        {"role": "tool", "tool_call_id": "call_a", "content": "r"},
    ]
    raw_tools = (
        b'{"model": "ds4", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], '
        b'"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",}}}]}'
    )
    return {
        "malformed tool-call arguments": ({**base, "messages": bad_args}, "/v1/chat/completions"),
        "malformed tool-call arguments, streamed": (
            {**base, "messages": bad_args, "stream": True},
            "/v1/chat/completions",
        ),
        "tool result answering no call": (
            {**base, "messages": [user, {"role": "tool", "tool_call_id": "call_nope", "content": "r"}]},
            "/v1/chat/completions",
        ),
        "tool_result answering no tool_use (anthropic)": (
            {
                "model": "ds4",
                "max_tokens": 2,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}],
                    }
                ],
            },
            "/v1/messages",
        ),
        "stream_options without stream": (
            {**base, "messages": [user], "stream_options": {"include_usage": True}},
            "/v1/chat/completions",
        ),
        "stream_options not an object": (
            {**base, "messages": [user], "stream": True, "stream_options": 5},
            "/v1/chat/completions",
        ),
        "stream_options.include_usage not a boolean": (
            {**base, "messages": [user], "stream": True, "stream_options": {"include_usage": "maybe"}},
            "/v1/chat/completions",
        ),
        "tool schema not an object": ({**base, "messages": [user], "tools": [5]}, "/v1/chat/completions"),
        "tool parameters a string, not JSON": (
            {
                **base,
                "messages": [user],
                "tools": [{"type": "function", "function": {"name": "f", "parameters": "{not json"}}],
            },
            "/v1/chat/completions",
        ),
        "tool schema with invalid JSON in the body": (raw_tools, "/v1/chat/completions"),
    }


#: What each answer must say: the field (or, for a body that is not JSON, the byte offset).
EXPECTED_ERRORS = {
    "malformed tool-call arguments": "messages[1].tool_calls[0].function.arguments: not valid JSON",
    "malformed tool-call arguments, streamed": "messages[1].tool_calls[0].function.arguments: not valid JSON",
    "tool result answering no call": "messages[1].tool_call_id: 'call_nope' answers no tool call",
    "tool_result answering no tool_use (anthropic)": "messages[0].content[0].tool_use_id: 'toolu_x'",
    "stream_options without stream": "stream_options",
    "stream_options not an object": "stream_options",
    "stream_options.include_usage not a boolean": "stream_options.include_usage",
    "tool schema not an object": "tools.0",
    "tool parameters a string, not JSON": "tools.0.function.parameters",
    "tool schema with invalid JSON in the body": "JSON decode error",
}


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("bad-input")
    args = [
        "--model", "ds4", "--max-model-len", str(MAX_MODEL_LEN), "--dtype", "float32",
        "--kv-connector", "ds4disk", "--kv-disk-dir", str(base / "kv"), "--kv-cache-min-tokens", "64",
        "--tool-memory-max-ids", str(TOOL_MEMORY_MAX_IDS),
    ]  # fmt: skip
    server = ServerProcess(args, base / "serve.log").start()
    out: dict = {"log": server.log_path}
    try:
        out["probe_cold"] = ask_probe(server)
        out["probe_warm"] = ask_probe(server)
        out["errors"] = {
            name: error_of(post(server, body, path)) for name, (body, path) in bad_requests().items()
        }
        out["tool_memory"] = exceed_the_tool_memory(server)
        out["probe_after"] = ask_probe(server)
        out["health"] = httpx.get(f"{server.base_url}/health", timeout=30).status_code
    finally:
        server.stop()
    return out


def exceed_the_tool_memory(server: ServerProcess) -> dict:
    """Three calls sampled in one conversation (one more than the memory holds), then the whole
    history sent back, and a history naming a near miss of a remembered id."""
    messages = list(TOOL_TALK)
    ids: list[str] = []
    for n in (1, 2, 3):
        response = post(
            server,
            {
                "model": "ds4",
                "messages": messages,
                "tools": TOOLS,
                "max_tokens": 200,
                **forced(sampled_block(n)),
            },
        )
        assert response.status_code == 200, response.text
        (call,) = response.json()["choices"][0]["message"]["tool_calls"]
        ids.append(call["id"])
        messages += [
            assistant_call(call["id"], call["function"]["arguments"]),
            {"role": "tool", "tool_call_id": call["id"], "content": f"contents of file {n}"},
        ]
    whole = {"model": "ds4", "messages": messages, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True}
    near = ids[2][:-1] + ("0" if ids[2][-1] != "0" else "1")
    near_miss = {
        **whole,
        "messages": [
            *TOOL_TALK,
            assistant_call(near, json.dumps({"limit": 30, "path": "file_3.txt"})),
            {"role": "tool", "tool_call_id": near, "content": "contents of file 3"},
        ],
    }
    result = {"ids": ids, "requests": {}, "responses": {}}
    for name, body in (("whole", whole), ("near miss", near_miss)):
        raw = json.dumps(body).encode()
        response = post(server, raw)
        result["requests"][name] = raw
        result["responses"][name] = (response.status_code, response.json())
    return result


@pytest.mark.parametrize("name", list(EXPECTED_ERRORS))
def test_bad_input_gets_a_4xx_naming_the_problem(run, name) -> None:
    status, message = run["errors"][name]
    assert status in (400, 422), (status, message)
    assert EXPECTED_ERRORS[name] in message


def test_a_history_over_the_tool_memory_cap_renders_the_oldest_call_canonically(run) -> None:
    memory = run["tool_memory"]
    status, body = memory["responses"]["whole"]
    assert status == 200, body
    text = default_tokenizer().decode_bytes(body["prompt_token_ids"]).decode("utf-8")
    blocks = {memory["ids"][n - 1]: sampled_block(n) for n in (1, 2, 3)}
    # The memory holds the two most recent ids: call 1 is rendered from the client's JSON.
    newest = {i: blocks[i] for i in memory["ids"][1:]}
    expected = render_chat_completion(memory["requests"]["whole"], ctx_size=MAX_MODEL_LEN, replay=newest.get)
    assert text == expected.text
    assert sampled_block(1) not in text and sampled_block(2) in text and sampled_block(3) in text
    assert '<｜DSML｜parameter name="limit" string="false">10</｜DSML｜parameter>' in text  # canonical


def test_an_id_one_character_off_is_rendered_canonically(run) -> None:
    memory = run["tool_memory"]
    status, body = memory["responses"]["near miss"]
    assert status == 200, body
    text = default_tokenizer().decode_bytes(body["prompt_token_ids"]).decode("utf-8")
    expected = render_chat_completion(memory["requests"]["near miss"], ctx_size=MAX_MODEL_LEN)
    assert text == expected.text  # no replay at all: never another conversation's bytes
    assert sampled_block(3) not in text


def test_after_the_bad_input_a_normal_request_still_hits_and_answers_the_same(run) -> None:
    cold, warm, after = run["probe_cold"], run["probe_warm"], run["probe_after"]
    assert run["health"] == 200
    assert cold["prompt_cache_hit_tokens"] == 0
    for usage in (warm, after):
        assert usage["prompt_tokens"] == cold["prompt_tokens"]
        assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]
        # at least every full block of the prompt, from memory or disk
        assert usage["prompt_cache_hit_tokens"] >= usage["prompt_tokens"] // BLOCK * BLOCK > 0
    assert after["content"] == warm["content"] == cold["content"]
    # No request was answered with a server error (vLLM logs the Anthropic route's 400s with a
    # traceback, and its engine client logs one at shutdown: the access log is what counts).
    assert not re.findall(r'HTTP/1\.1" 5\d\d', run["log"].read_text(errors="replace"))
