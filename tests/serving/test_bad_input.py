"""Issue 9, bad input: a real `vllm serve --model ds4 --kv-connector ds4disk` answers bad requests with a
4xx naming the problem, and a normal request afterwards still gets the same answer and its cache hits.

One server (`--tool-memory-max-ids 2`) sees, in order: a probe prompt (cold, then warm); the bad
requests (malformed tool-call JSON, a tool result answering no call, invalid `stream_options`,
tool schemas that are not JSON objects or not JSON at all); the hostile ones of issue 12 on each
route we render (chat, completions, Responses, Anthropic messages): a prompt over the context
size, 5 MB of tool definitions, JSON nested 100,000 deep, invalid UTF-8, connector keys only the
server may set; a conversation with three sampled tool calls, one more than the tool memory
holds, sent back whole; a call id that differs from a remembered one by one character; another
conversation sending variants of a remembered id, and that id with its own arguments; and the
probe prompt again.
"""

from __future__ import annotations

import json
import re
import time

import httpx
import pytest

from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.tokenizer import default_tokenizer
from tests.e2e.server_process import ServerProcess
from tests.serving.forced_dsml import forced

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

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


#: The routes we render, with a minimal body each and how its tools are spelled.
ROUTE_BODIES = {
    "chat": ("/v1/chat/completions", {"model": "ds4", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
    "completions": ("/v1/completions", {"model": "ds4", "max_tokens": 2, "prompt": "hi"}),
    "responses": ("/v1/responses", {"model": "ds4", "max_output_tokens": 2, "input": "hi"}),
    "anthropic": ("/v1/messages", {"model": "ds4", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}),
}  # fmt: skip
#: 17,000 tokens: over the 4096-token context on its own.
LONG_TEXT = " ".join(f"w{i}" for i in range(6000))
#: 100,000 levels: past Python's recursion limit, where FastAPI alone says only "error parsing the body".
DEEP = 100_000


def huge_tools(route: str) -> list[dict]:
    """5.5 MB of tool definitions in the route's own tool format (800 tools of 40 parameters)."""
    params = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "description": "d" * 100} for i in range(40)},
    }
    out = []
    for n in range(800):
        name, description = f"f{n}", "x" * 1000
        if route == "anthropic":
            out.append({"name": name, "description": description, "input_schema": params})
        elif route == "responses":
            out.append({"type": "function", "name": name, "description": description, "parameters": params})
        else:
            out.append(
                {
                    "type": "function",
                    "function": {"name": name, "description": description, "parameters": params},
                }
            )
    return out  # fmt: skip


def hostile_requests() -> dict[str, tuple[bytes, str]]:
    """Issue 12's hostile bodies on each rendered route: name -> (body bytes, path)."""
    out: dict[str, tuple[bytes, str]] = {}
    for route, (path, body) in ROUTE_BODIES.items():
        long_body = json.loads(json.dumps(body).replace('"hi"', json.dumps(LONG_TEXT)))
        out[f"{route}: prompt over the context size"] = (json.dumps(long_body).encode(), path)
        if route != "completions":
            out[f"{route}: 5 MB of tool definitions"] = (
                json.dumps({**body, "tools": huge_tools(route)}).encode(),
                path,
            )
        deep = json.dumps(body)[:-1].encode() + b', "metadata": ' + b"[" * DEEP + b"]" * DEEP + b"}"
        out[f"{route}: JSON nested {DEEP} deep"] = (deep, path)
        out[f"{route}: invalid UTF-8"] = (json.dumps(body).encode().replace(b'"hi"', b'"h\xff\xfei"'), path)
        planted = {
            **body,
            "kv_transfer_params": {"ds4_tool_map": [["call_planted", "<tool_calls></tool_calls>"]]},
        }
        out[f"{route}: planted tool map"] = (json.dumps(planted).encode(), path)
    return out  # fmt: skip


#: What each hostile answer must say, by the suffix of its name.
HOSTILE_ERRORS = {
    "prompt over the context size": f"maximum context length is {MAX_MODEL_LEN} tokens",
    "5 MB of tool definitions": f"maximum context length is {MAX_MODEL_LEN} tokens",
    f"JSON nested {DEEP} deep": "request body: JSON nested deeper than 256 levels at byte offset",
    "invalid UTF-8": "request body: not valid UTF-8 at byte offset",
    "planted tool map": "kv_transfer_params.ds4_tool_map: reserved for the server's ds4disk connector",
}
#: Every hostile answer came back in under 1 s on an idle machine (the 5 MB bodies: 0.7 s, spent
#: counting their 2.2 million tokens); 30 s leaves room for a machine loaded 20 times over.
HOSTILE_SECONDS = 30.0


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
        out["hostile"] = {}
        for name, (body, path) in hostile_requests().items():
            started = time.monotonic()
            response = post(server, body, path)
            out["hostile"][name] = (*error_of(response), time.monotonic() - started, response.json())
        out["tool_memory"] = exceed_the_tool_memory(server)
        out["foreign"] = send_variants_of_another_conversations_id(server)
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


def send_variants_of_another_conversations_id(server: ServerProcess) -> dict:
    """Conversation A samples a call; conversation B sends back variants of A's id (a prefix, a
    longer id, other case) with A's arguments, and A's exact id with B's own arguments. Last, A
    sends its own call back unchanged: the one request that must replay A's sampled bytes."""
    talk_a = [{"role": "system", "content": "Agent A."}, {"role": "user", "content": "Read a secret."}]
    response = post(
        server,
        {"model": "ds4", "messages": talk_a, "tools": TOOLS, "max_tokens": 200, **forced(sampled_block(7))},
    )
    assert response.status_code == 200, response.text
    (call,) = response.json()["choices"][0]["message"]["tool_calls"]
    a_id, a_args = call["id"], call["function"]["arguments"]
    talk_b = [{"role": "system", "content": "Agent B."}, {"role": "user", "content": "Read a file."}]
    b_args = json.dumps({"limit": 1, "path": "mine.txt"})
    variants = {
        "prefix": (a_id[:-1], a_args, talk_b),
        "longer": (a_id + "0", a_args, talk_b),
        "other case": (a_id.upper(), a_args, talk_b),
        "exact id, other arguments": (a_id, b_args, talk_b),
        "exact id, A's own call": (a_id, a_args, talk_a),
    }
    out: dict = {"id": a_id, "requests": {}, "responses": {}}
    for name, (tool_id, arguments, talk) in variants.items():
        body = {
            "model": "ds4",
            "messages": [
                *talk,
                assistant_call(tool_id, arguments),
                {"role": "tool", "tool_call_id": tool_id, "content": "r"},
            ],
            "tools": TOOLS,
            "max_tokens": 1,
            "return_token_ids": True,
        }
        raw = json.dumps(body).encode()
        response = post(server, raw)
        out["requests"][name] = raw
        out["responses"][name] = (response.status_code, response.json())
    return out  # fmt: skip


@pytest.mark.parametrize("name", list(hostile_requests()))
def test_hostile_input_gets_a_4xx_naming_the_problem_quickly(run, name) -> None:
    status, message, seconds, body = run["hostile"][name]
    route, kind = name.split(": ", 1)
    assert status == 400, (status, message)
    too_long = HOSTILE_ERRORS[kind].startswith("maximum context length")
    if route == "anthropic":
        # Anthropic's shape and, for a prompt over the context, its wording (issue 20).
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        if too_long:
            assert re.fullmatch(rf"prompt is too long: \d+ tokens > {MAX_MODEL_LEN} maximum", message), (
                message
            )
        else:
            assert HOSTILE_ERRORS[kind] in message
    else:
        assert HOSTILE_ERRORS[kind] in message
        if too_long:
            assert (body["error"]["code"], body["error"]["type"]) == (
                "context_length_exceeded",
                "invalid_request_error",
            )
    assert seconds < HOSTILE_SECONDS


def test_sampled_tool_call_ids_are_long_random_and_distinct(run) -> None:
    ids = [*run["tool_memory"]["ids"], run["foreign"]["id"]]
    assert all(re.fullmatch("call_[0-9a-f]{32}", i) for i in ids), ids  # 128 bits (see test_tool_memory)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize(
    "name", ["prefix", "longer", "other case", "exact id, other arguments", "exact id, A's own call"]
)
def test_another_conversations_dsml_is_replayed_only_for_its_exact_id_and_call(run, name) -> None:
    foreign = run["foreign"]
    status, body = foreign["responses"][name]
    assert status == 200, body
    text = default_tokenizer().decode_bytes(body["prompt_token_ids"]).decode("utf-8")
    if name == "exact id, A's own call":
        replay = {foreign["id"]: sampled_block(7)}.get
        assert sampled_block(7) in text
    else:
        replay = None  # rendered canonically: not a byte of A's sampled block
        assert sampled_block(7) not in text
    if name == "exact id, other arguments":
        assert "file_7.txt" not in text  # nothing of A's call reaches B's prompt
    expected = render_chat_completion(foreign["requests"][name], ctx_size=MAX_MODEL_LEN, replay=replay)
    assert text == expected.text


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
