"""Issue 9, rendering: a real `vllm serve --model ds4` builds the ds4 engine's exact prompt on all four
routes, from the bytes the `openai` and `anthropic` SDKs send.

What the server built is read back from the server: `prompt_token_ids` (chat and completions with
`return_token_ids`), the Responses `input_messages` (`enable_response_messages`), and for
/v1/messages the render endpoint of the same body (`--enable-scale-out`) plus the usage the real
route reports. Each is compared with `ds4_vllm.chat`'s rendering of the captured request bytes
(text byte for byte, ids as the engine's tokenizer cuts them), and for the engine's own requests
(shared/testdata/ds4-engine/manifest.json) with the engine's checkpoint texts and token counts.
"""

from __future__ import annotations

import json
import re

import httpx
import pytest

from ds4_vllm.chat.anthropic_request import render_anthropic_messages
from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.completion_request import render_completion
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.template import RenderedPrompt
from ds4_vllm.chat.tokenizer import ASSISTANT, THINK_END, default_tokenizer
from tests.e2e.server_process import ServerProcess
from tests.shared_data import ENGINE_TESTDATA

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 8192  # R2 of the manifest is 4,687 prompt tokens
TESTDATA = ENGINE_TESTDATA

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-render") / "vllm-serve.log"
    args = ["--model", "ds4", "--max-model-len", str(MAX_MODEL_LEN), "--enable-scale-out"]
    # No --served-model-name: the engine's recorded requests ask for model "deepseek-v4-flash",
    # which a ds4 server answers to by default, as the engine does (issue 20).
    proc = ServerProcess(args, log).start()
    yield proc
    proc.stop()


class Captured:
    """The request bodies an SDK put on the wire, in order."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []

    def client(self, httpx_module=httpx):
        """An HTTP client for an SDK (the anthropic SDK brings its own `httpx2` package)."""
        return httpx_module.Client(
            timeout=300, event_hooks={"request": [lambda r: self.bodies.append(r.read())]}
        )


@pytest.fixture()
def captured() -> Captured:
    return Captured()


@pytest.fixture()
def openai_client(server, captured):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", http_client=captured.client())


@pytest.fixture()
def anthropic_client(server, captured):
    import httpx2
    from anthropic import Anthropic

    return Anthropic(base_url=server.base_url, api_key="unused", http_client=captured.client(httpx2))


def post(server, path: str, body: bytes) -> httpx.Response:
    return httpx.post(
        f"{server.base_url}{path}", content=body, headers={"content-type": "application/json"}, timeout=300
    )


def assert_prompt(ids: list[int], expected: RenderedPrompt) -> None:
    tok = default_tokenizer()
    assert tok.decode_bytes(ids) == expected.text_bytes
    assert ids == tok.encode(expected.text)


# -- /v1/chat/completions --------------------------------------------------------------------------

CHAT_CASES = {
    "tools, tool_choice auto by default": dict(
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Rome?"},
        ],
        tools=TOOLS,
    ),
    "tool calls and tool results in the history": dict(
        messages=[
            {"role": "user", "content": "Weather in Rome and the time?"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Two tools.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{ "days": 2,"city" : "Rome <&>"}'},
                    },
                    {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": "{}"}},
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny </tool_result> 21C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
            {"role": "user", "content": "Thanks, and tomorrow?"},
        ],
        tools=TOOLS,
    ),
    "developer message, old reasoning, thinking off": dict(
        messages=[
            {"role": "developer", "content": "Dev rules."},
            {"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}]},
            {"role": "assistant", "content": "C", "reasoning_content": "dropped without tools"},
            {"role": "user", "content": "«D»\n\n"},
        ],
        extra_body={"thinking": {"type": "disabled"}},
    ),
    "reasoning_effort max below the 393216 context": dict(
        messages=[{"role": "user", "content": "hi"}],
        reasoning_effort="max",
    ),
}


@pytest.mark.parametrize("case", CHAT_CASES)
def test_chat_prompt_is_the_engines(openai_client, captured, case: str) -> None:
    kwargs = dict(CHAT_CASES[case])
    extra = {"return_token_ids": True, **kwargs.pop("extra_body", {})}
    reply = openai_client.chat.completions.create(model="ds4", max_tokens=1, extra_body=extra, **kwargs)
    expected = render_chat_completion(captured.bodies[-1], ctx_size=MAX_MODEL_LEN)
    assert_prompt(reply.model_dump()["prompt_token_ids"], expected)
    assert reply.usage.prompt_tokens == len(default_tokenizer().encode(expected.text))


def test_vllm_thinking_switch_applies_when_the_body_has_none(openai_client, captured) -> None:
    # The engine reads `thinking`/`think`; vLLM clients also send chat_template_kwargs. The switch
    # counts as the body's `thinking` (the engine's own fields win when both are given).
    reply = openai_client.chat.completions.create(
        model="ds4",
        max_tokens=1,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    body = json.loads(captured.bodies[-1])
    expected = render_chat_completion({**body, "thinking": False}, ctx_size=MAX_MODEL_LEN)
    assert expected.text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜></think>"
    assert_prompt(reply.model_dump()["prompt_token_ids"], expected)


@pytest.mark.parametrize(
    ("model", "prompt_end"),
    [("deepseek-chat", "<｜Assistant｜></think>"), ("deepseek-reasoner", "<｜Assistant｜><think>")],
)
def test_the_engines_model_aliases_are_served_and_select_thinking(
    server, openai_client, model: str, prompt_end: str
) -> None:
    """Issue 20: `deepseek-chat` got a 404; the engine serves it with thinking off, and
    `deepseek-reasoner` with thinking on, when the body says nothing about thinking."""
    reply = openai_client.chat.completions.create(
        model=model,
        max_tokens=1,
        messages=[{"role": "user", "content": "hi"}],
        extra_body={"return_token_ids": True},
    )
    text = default_tokenizer().decode(reply.model_dump()["prompt_token_ids"])
    assert text == "<｜begin▁of▁sentence｜><｜User｜>hi" + prompt_end
    models = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["ds4", "deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner"]


def test_chat_renders_tools_and_tool_history(openai_client, captured) -> None:
    kwargs = CHAT_CASES["tool calls and tool results in the history"]
    reply = openai_client.chat.completions.create(
        model="ds4", max_tokens=1, extra_body={"return_token_ids": True}, **kwargs
    )
    text = default_tokenizer().decode_bytes(reply.model_dump()["prompt_token_ids"]).decode()
    schema = json.dumps(TOOLS[0]["function"], separators=(",", ":"))  # the SDK sends compact JSON
    assert f"### Available Tool Schemas\n\n{schema}\n" in text
    assert (
        '<｜Assistant｜><think>Two tools.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="city" string="true">Rome <&></｜DSML｜parameter>\n'
    ) in text
    assert (
        "<｜User｜><tool_result>sunny &lt;/tool_result> 21C</tool_result><tool_result>12:00</tool_result>"
        "<｜User｜>Thanks, and tomorrow?<｜Assistant｜><think>"
    ) in text


def test_tool_choice_none_is_accepted_and_leaves_tools_out_as_the_engine_does(
    openai_client, captured
) -> None:
    reply = openai_client.chat.completions.create(
        model="ds4",
        max_tokens=1,
        messages=[{"role": "user", "content": "hi"}],
        tools=TOOLS,
        tool_choice="none",
        extra_body={"return_token_ids": True},
    )
    assert "tool_choice" in json.loads(captured.bodies[-1])
    expected = render_chat_completion(captured.bodies[-1], ctx_size=MAX_MODEL_LEN)
    assert expected.text == "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>"
    assert_prompt(reply.model_dump()["prompt_token_ids"], expected)


def test_tool_schemas_are_the_clients_raw_bytes(server) -> None:
    schema = '{ "name" : "f",\n  "parameters": {"type":"object" , "properties":{ "n": {"type": "number", "default": 1.50}}} }'
    body = (
        '{"model":"ds4","max_tokens":1,"return_token_ids":true,'
        f'"messages":[{{"role":"user","content":"x"}}],"tools":[{{"type":"function","function":{schema}}}]}}'
    ).encode()
    reply = post(server, "/v1/chat/completions", body)
    assert reply.status_code == 200, reply.text
    ids = reply.json()["prompt_token_ids"]
    assert schema.encode() in default_tokenizer().decode_bytes(ids)
    assert_prompt(ids, render_chat_completion(body, ctx_size=MAX_MODEL_LEN))


# -- /v1/completions -------------------------------------------------------------------------------


def test_completion_prompts_get_the_engines_wrapper(openai_client, captured) -> None:
    reply = openai_client.completions.create(
        model="ds4", prompt="Once upon", max_tokens=1, extra_body={"return_token_ids": True, "think": False}
    )
    expected = render_completion(captured.bodies[-1], ctx_size=MAX_MODEL_LEN)
    assert expected.text.endswith("<｜User｜>Once upon<｜Assistant｜></think>")
    assert_prompt(reply.model_dump()["choices"][0]["prompt_token_ids"], expected)


def test_completion_token_prompts_are_used_as_given(openai_client) -> None:
    ids = default_tokenizer().encode("Once upon")
    reply = openai_client.completions.create(
        model="ds4", prompt=ids, max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert reply.model_dump()["choices"][0]["prompt_token_ids"] == ids


# -- /v1/responses ---------------------------------------------------------------------------------


def test_responses_prompt_is_the_engines(openai_client, captured) -> None:
    reply = openai_client.responses.create(
        model="ds4",
        instructions="Be terse.",
        input=[
            {"role": "user", "content": "Weather in Rome?"},
            {
                "type": "function_call",
                "call_id": "call_9",
                "name": "get_weather",
                "arguments": '{"city":"Rome"}',
                "status": "completed",
            },
            {"type": "function_call_output", "call_id": "call_9", "output": "sunny"},
        ],
        tools=[
            {"type": "function", "name": "get_weather", "parameters": {"type": "object"}, "strict": False}
        ],
        max_output_tokens=1,
        extra_body={"enable_response_messages": True},
    )
    expected = render_responses(captured.bodies[-1], ctx_size=MAX_MODEL_LEN)
    (message,) = reply.model_dump()["input_messages"]
    assert message["message"] == expected.text
    assert_prompt(message["tokens"], expected)
    assert reply.usage.input_tokens == len(message["tokens"])


# -- /v1/messages (Anthropic) ----------------------------------------------------------------------


def test_anthropic_prompt_is_the_engines(server, anthropic_client, captured) -> None:
    request = dict(
        model="ds4",
        max_tokens=1,
        system=[{"type": "text", "text": "First.\n"}, {"type": "text", "text": "Second."}],
        messages=[
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Oslo"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "snow"}],
            },
        ],
        tools=[{"name": "get_weather", "description": "W", "input_schema": {"type": "object"}}],
        thinking={"type": "disabled"},
    )
    reply = anthropic_client.messages.create(**request)
    body = captured.bodies[-1]
    expected = render_anthropic_messages(body, ctx_size=MAX_MODEL_LEN)
    assert "First.\nSecond." in expected.text and "<tool_result>snow</tool_result>" in expected.text
    rendered = post(server, "/v1/messages/render", body)
    assert rendered.status_code == 200, rendered.text
    assert_prompt(rendered.json()["token_ids"], expected)
    n_ids = len(default_tokenizer().encode(expected.text))
    # ds4's Anthropic usage (spec §7.2): input = P - read - creation, so the prompt is their sum.
    usage = reply.usage
    assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == n_ids
    assert (
        anthropic_client.messages.count_tokens(
            **{k: v for k, v in request.items() if k != "max_tokens"}
        ).input_tokens
        == n_ids
    )


def test_rendering_errors_are_client_errors(server) -> None:
    reply = post(
        server, "/v1/responses", b'{"model":"ds4","input":[{"type":"mystery"}],"max_output_tokens":1}'
    )
    assert reply.status_code == 400, reply.text
    body = b'{"model":"ds4","input":"hi","max_output_tokens":1,"tools":[{"type":"function","name":"f"}],"tool_choice":"required"}'
    reply = post(server, "/v1/responses", body)
    assert reply.status_code == 400 and "tool_choice=required not supported" in reply.text


# -- the ds4 engine's own requests -----------------------------------------------------------------

CTX = {"q2": 16384, "q4": 20000}  # the engine runs' -c (manifest "runs"); only max effort reads it


def engine_texts(manifest: dict, request: str) -> list[bytes]:
    """Checkpoint texts the engine wrote for a request's prompt (a prefix, or prompt + answer)."""
    from ds4_vllm.kvc import open_checkpoint

    same = {name for name, r in manifest["requests"].items() if r.get("body_same_as") == request} | {request}
    texts = []
    for f in manifest["files"]:
        # "R1+R2": a session that served R1 then R2; its text is R2's prompt and answer.
        if f["key_kind"] == "token-text" and f["produced_by"].split()[0].split("+")[-1] in same:
            with open_checkpoint(TESTDATA / f["path"]) as ck:
                texts.append(bytes(ck.text))
    return texts


def served_prompt(server, request: dict) -> list[int]:
    """The server's prompt ids for an engine request body (1 new token; ids asked back)."""
    body = request["body"].encode()
    if request["endpoint"].endswith("/v1/responses"):
        reply = post(
            server, "/v1/responses", body[:-1] + b',"max_output_tokens":1,"enable_response_messages":true}'
        )
        assert reply.status_code == 200, reply.text
        return reply.json()["input_messages"][0]["tokens"]
    reply = post(
        server, "/v1/chat/completions", body[:-1] + b',"max_tokens":1,"seed":null,"return_token_ids":true}'
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["prompt_token_ids"]


@pytest.mark.parametrize(
    ("request_name", "reported"),
    [
        ("R1", r"usage prompt (\d+)"),
        ("R3", None),
        ("R4", r"usage input (\d+)"),
        ("Q1", r"usage prompt (\d+)"),
    ],
)
def test_engine_requests_get_the_engines_prompt(
    server, manifest, request_name: str, reported: str | None
) -> None:
    request = manifest["requests"][request_name]
    ids = served_prompt(server, request)
    text = default_tokenizer().decode_bytes(ids)
    render = render_responses if request["endpoint"].endswith("/v1/responses") else render_chat_completion
    assert text == render(request["body"].encode(), ctx_size=CTX[request["run"]]).text_bytes
    files = engine_texts(manifest, request_name)
    assert files
    for file_text in files:
        n = min(len(text), len(file_text))
        assert file_text[:n] == text[:n]
    if reported:
        assert len(ids) == int(re.search(reported, request["outcome"]).group(1))


def test_engine_tool_call_history_matches_up_to_the_replayed_block(server, manifest) -> None:
    # R2 sends R1's tool call back; the engine rendered the sampled DSML bytes from its tool memory
    # (exact replay, not part of this server yet), we render the call canonically.
    request = manifest["requests"]["R2"]
    text = default_tokenizer().decode_bytes(served_prompt(server, request))
    canonical = render_chat_completion(request["body"].encode(), ctx_size=CTX["q2"]).text_bytes
    assert text == canonical
    block_at = text.index(f"{ASSISTANT}<think>{THINK_END}\n\n".encode()) + len(
        f"{ASSISTANT}<think>{THINK_END}".encode()
    )
    files = [t for t in engine_texts(manifest, "R2") if len(t) > block_at]
    assert files
    for file_text in files:
        assert file_text[:block_at] == text[:block_at]


#: Over the 8,192-token context on its own (about 9,000 tokens).
OVER_THE_CONTEXT = "word " * 9000


def test_anthropic_sdk_errors_are_anthropics(anthropic_client) -> None:
    """Issue 20: /v1/messages answered errors in OpenAI's shape or with Python exception names."""
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as too_long:
        anthropic_client.messages.create(
            model="ds4", max_tokens=4, messages=[{"role": "user", "content": OVER_THE_CONTEXT}]
        )
    assert too_long.value.body["type"] == "error"
    assert too_long.value.body["error"]["type"] == "invalid_request_error"
    # The wording Anthropic clients match before they compact the conversation.
    assert re.fullmatch(
        r"prompt is too long: \d+ tokens > 8192 maximum", too_long.value.body["error"]["message"]
    )
    with pytest.raises(anthropic.NotFoundError) as no_model:
        anthropic_client.messages.create(
            model="nope", max_tokens=4, messages=[{"role": "user", "content": "hi"}]
        )
    assert no_model.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as invalid:
        anthropic_client.messages.create(
            model="ds4", max_tokens="x", messages=[{"role": "user", "content": "hi"}]
        )
    assert invalid.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in invalid.value.body["error"]["message"]


def test_openai_sdk_sees_context_length_exceeded(openai_client) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as too_long:
        openai_client.chat.completions.create(
            model="ds4", max_tokens=4, messages=[{"role": "user", "content": OVER_THE_CONTEXT}]
        )
    assert too_long.value.code == "context_length_exceeded"
    assert too_long.value.body["param"] == "messages"


def test_reasoning_cut_by_max_tokens_is_reasoning_streamed_or_not(openai_client, anthropic_client) -> None:
    """Issue 20: an answer cut before `</think>` came back as content when not streamed and as
    reasoning when streamed, with reasoning_tokens 0. Now it is reasoning both ways, every token
    of it counted (greedy, so both runs produce the same 6 tokens)."""
    args = dict(
        model="deepseek-reasoner", max_tokens=6, temperature=0, messages=[{"role": "user", "content": "hi"}]
    )
    whole = openai_client.chat.completions.create(**args, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and "</think>" not in default_tokenizer().decode(
        choice.model_dump()["token_ids"]
    )
    reasoning = choice.message.model_dump()["reasoning"]
    assert reasoning and not choice.message.content
    assert whole.usage.completion_tokens_details.reasoning_tokens == whole.usage.completion_tokens == 6

    streamed_reasoning, streamed_content, usage = "", "", None
    for chunk in openai_client.chat.completions.create(
        **args, stream=True, stream_options={"include_usage": True}
    ):
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            delta = c.delta.model_dump()
            streamed_reasoning += delta.get("reasoning") or ""
            streamed_content += delta.get("content") or ""
    assert (streamed_reasoning, streamed_content) == (reasoning, "")
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens == 6

    message = anthropic_client.messages.create(
        model="deepseek-reasoner",  # thinking on, as the engine selects it for this name
        max_tokens=6,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "hi"}],
    )
    assert message.stop_reason == "max_tokens"
    assert [block.type for block in message.content] == ["thinking"]


NOW_TOOL = {
    "type": "function",
    "function": {"name": "now", "parameters": {"type": "object", "properties": {}}},
}
#: `</think>` made certain at the first step: the tiny random model would think until max_tokens.
CLOSE_THINKING_AT_ONCE = {"logit_bias": {str(default_tokenizer().encode("</think>")[0]): 100}}


@pytest.mark.parametrize(
    ("model", "tool_choice", "extra"),
    [
        ("deepseek-chat", "required", {}),
        ("deepseek-chat", {"type": "function", "function": {"name": "now"}}, {}),
        ("deepseek-reasoner", "required", CLOSE_THINKING_AT_ONCE),
    ],
    ids=["required", "named", "required-after-thinking"],
)
def test_forced_tool_choice_is_a_tool_call(openai_client, model, tool_choice, extra) -> None:
    """Issue 20: "required" and a named function were not enforced (an unconstrained tiny model
    answers with random text). The DSML structural tag makes the answer a call of a listed tool,
    its arguments valid for the tool's schema, after the reasoning when thinking is on."""
    weather = dict(TOOLS[0])
    reply = openai_client.chat.completions.create(
        model=model,
        max_tokens=300,
        temperature=0,
        parallel_tool_calls=False,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[weather, NOW_TOOL],
        tool_choice=tool_choice,
        extra_body=extra,
    )
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name in {"now", "get_weather"}
    if isinstance(tool_choice, dict):
        assert call.function.name == "now"
    arguments = json.loads(call.function.arguments)
    if call.function.name == "now":
        assert arguments == {}
    else:
        assert isinstance(arguments.get("city"), str)
    assert not reply.choices[0].message.content


def test_anthropic_forced_tool_is_a_tool_use(anthropic_client) -> None:
    message = anthropic_client.messages.create(
        model="deepseek-chat",
        max_tokens=300,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[{"name": "now", "input_schema": {"type": "object", "properties": {}}}],
        tool_choice={"type": "tool", "name": "now", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    assert [(b.type, b.name, b.input) for b in message.content if b.type == "tool_use"] == [
        ("tool_use", "now", {})
    ]
