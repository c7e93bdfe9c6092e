"""The `ds4` tool and reasoning parsers inside vLLM's own parser composition (no engine needed).

vLLM composes `--tool-call-parser ds4 --reasoning-parser ds4` into one `DelegatingParser`; these
tests drive that composed class exactly as the chat, Anthropic and Responses routes do: `parse` for
whole answers and `parse_delta` for streams.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.parser.parser_manager import ParserManager

from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.messages import ToolCall as RenderCall
from ds4_vllm.chat.tokenizer import THINK_END, THINK_START, default_tokenizer
from ds4_vllm.contracts import TOOL_IDS_KEY, TOOL_MAP_KEY
from ds4_vllm.serving.parsers import register_parsers
from ds4_vllm.serving.state import ServingState, register_for_tokenizer, serving_state_for_tokenizer
from ds4_vllm.store.tool_memory import ToolMemory, tool_call_id

P = "</｜DSML｜parameter>"
BLOCK = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="run">\n'
    '<｜DSML｜parameter name="cmd" string="true">ls &amp;&amp; echo "a&lt;b"' + P + "\n"
    '<｜DSML｜parameter name="timeout" string="false"> 10 ' + P + "\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="read">\n'
    '<｜DSML｜parameter name="paths" string="false">[ "a", "b" ]' + P + "\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)
TOOLS = [
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}},
]
ANSWER = "I will look.  \n" + BLOCK


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


@pytest.fixture(scope="module")
def parser_cls():
    register_parsers()
    return ParserManager.get_parser(
        tool_parser_name="ds4", reasoning_parser_name="ds4", enable_auto_tools=True
    )


def fresh_memory(tokenizer, max_ids: int = 100_000) -> ToolMemory:
    """A new server state for the parsers built from `tokenizer`, as a renderer registers its own."""
    return register_for_tokenizer(
        tokenizer, ServingState(tool_memory=ToolMemory(max_ids), with_connector=True)
    ).tool_memory


@pytest.fixture
def memory(tokenizer) -> ToolMemory:
    return fresh_memory(tokenizer, max_ids=50)


def _request(messages: list | None = None, **kw) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="ds4", messages=messages or [{"role": "user", "content": "hi"}], tools=TOOLS, **kw
    )


def _prepared(parser_cls, tokenizer, **kw) -> ChatCompletionRequest:
    request = _request(**kw)
    parser_cls(tokenizer, request.tools).adjust_request(request)
    return request


def test_adjust_request_keeps_specials_and_sends_a_fresh_secret_seed(parser_cls, tokenizer, memory) -> None:
    request = _request(
        kv_transfer_params={"other": 1, TOOL_IDS_KEY: {"seed": "00" * 16}, TOOL_MAP_KEY: [["x", "y"]]}
    )
    parser_cls(tokenizer, request.tools).adjust_request(request)
    assert request.skip_special_tokens is False and request.spaces_between_special_tokens is False
    params = request.kv_transfer_params
    assert params["other"] == 1 and params[TOOL_MAP_KEY] == []  # client-planted entries are replaced
    assert params[TOOL_IDS_KEY]["seed"] != "00" * 16 and len(params[TOOL_IDS_KEY]["seed"]) == 32
    assert params[TOOL_IDS_KEY]["prefix"] == "call_"
    # the seed goes to the engine with the request
    assert request.to_sampling_params(16, {}).extra_args["kv_transfer_params"] == params


def test_whole_answer_with_reasoning_and_two_calls(parser_cls, tokenizer, memory) -> None:
    request = _prepared(parser_cls, tokenizer)
    parser = parser_cls(tokenizer, request.tools)
    reasoning, content, calls = parser.parse(
        f"{THINK_START}plan{THINK_END}" + ANSWER, request, enable_auto_tools=True
    )
    assert (reasoning, content) == ("plan", "I will look.")
    seed = request.kv_transfer_params[TOOL_IDS_KEY]["seed"]
    assert [(c.id, c.name, c.arguments) for c in calls] == [
        (tool_call_id(seed, BLOCK, 0), "run", '{"cmd":"ls && echo \\"a<b\\"","timeout":10}'),
        (tool_call_id(seed, BLOCK, 1), "read", '{"paths":["a","b"]}'),
    ]
    assert [memory.peek(c.id) for c in calls] == [BLOCK, BLOCK]  # the exact sampled bytes


def test_answers_without_a_closed_block_stay_content(parser_cls, tokenizer, memory) -> None:
    request = _prepared(parser_cls, tokenizer)
    for text in ("plain answer\n", "cut short" + BLOCK[:-10], "<think>unfinished thought"):
        reasoning, content, calls = parser_cls(tokenizer, request.tools).parse(
            text, request, enable_auto_tools=True
        )
        assert (reasoning, content, calls) == (None, text, None)
    assert len(memory) == 0


def _stream(parser_cls, tokenizer, request, text: str, cuts: list[int], *, thinking: bool):
    parser = parser_cls(tokenizer, request.tools)
    prompt = [1, tokenizer.token_to_id(THINK_START if thinking else THINK_END)]
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    reasoning, content, calls = [], [], []
    for i, piece in enumerate(pieces):
        delta = parser.parse_delta(piece, [7], request, prompt, finished=i == len(pieces) - 1)
        if delta is None:
            continue
        reasoning.append(delta.reasoning or "")
        content.append(delta.content or "")
        calls.extend(delta.tool_calls)
    return "".join(reasoning), "".join(content), calls


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_streaming_split_anywhere_gives_the_whole_answer(parser_cls, tokenizer, data) -> None:
    fresh_memory(tokenizer)
    thinking = data.draw(st.booleans())
    text = (f"a thought {THINK_END}" if thinking else "") + ANSWER
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    request = _prepared(parser_cls, tokenizer)
    whole = parser_cls(tokenizer, request.tools).parse(text, request, enable_auto_tools=True)
    reasoning, content, calls = _stream(parser_cls, tokenizer, request, text, cuts, thinking=thinking)
    assert reasoning == (whole[0] or "") and content == whole[1]
    assert [(c.index, c.id, c.function.name, c.function.arguments) for c in calls] == [
        (i, c.id, c.name, c.arguments) for i, c in enumerate(whole[2])
    ]


def test_streaming_every_single_character(parser_cls, tokenizer, memory) -> None:
    text = "<think>x</think>ok <tool" + " tail\n\n"  # a false start of a block and trailing space
    request = _prepared(parser_cls, tokenizer)
    reasoning, content, calls = _stream(
        parser_cls, tokenizer, request, text, list(range(1, len(text))), thinking=True
    )
    assert (reasoning, content, calls) == ("x", "ok <tool tail\n\n", [])
    text = ANSWER + "text after the block is dropped"
    reasoning, content, calls = _stream(
        parser_cls, tokenizer, request, text, list(range(1, len(text))), thinking=False
    )
    assert (reasoning, content, [c.function.name for c in calls]) == ("", "I will look.", ["run", "read"])
    malformed = "see <tool_calls>oops</tool_calls> end"
    _, content, calls = _stream(parser_cls, tokenizer, request, malformed, [5, 9, 20], thinking=False)
    assert (content, calls) == (malformed, [])


def test_replayed_ids_render_the_sampled_bytes_and_travel_to_the_connector(
    parser_cls, tokenizer, memory
) -> None:
    request = _prepared(parser_cls, tokenizer)
    _, content, calls = parser_cls(tokenizer, request.tools).parse(ANSWER, request, enable_auto_tools=True)
    # the client sends the calls back with re-serialized arguments (other key order, spaces)
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": content,
            "tool_calls": [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": json.dumps(dict(reversed(json.loads(c.arguments).items()))),
                    },
                }
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0].id, "content": "ok"},
        {"role": "tool", "tool_call_id": calls[1].id, "content": "ok"},
    ]
    body = {"messages": history, "tools": TOOLS, "thinking": {"type": "disabled"}}
    replay = serving_state_for_tokenizer(tokenizer).replay
    text = render_chat_completion(body, ctx_size=4096, replay=replay).text
    assert "I will look." + BLOCK + "<｜end▁of▁sentence｜>" in text  # byte extension of the sampled answer
    canonical = render_chat_completion(body, ctx_size=4096).text
    assert BLOCK not in canonical  # without replay the re-serialized arguments would differ

    # an id that is not exactly known falls back to canonical rendering
    wrong = json.loads(json.dumps(history))
    wrong[1]["tool_calls"][0]["id"] = calls[0].id.upper()
    assert render_chat_completion({**body, "messages": wrong}, ctx_size=4096, replay=replay).text != text

    # the next request carries the history's blocks to the connector, keyed by id
    follow = _request(messages=history)
    parser_cls(tokenizer, follow.tools).adjust_request(follow)
    assert follow.kv_transfer_params[TOOL_MAP_KEY] == [[calls[0].id, BLOCK], [calls[1].id, BLOCK]]


def test_render_of_remembered_single_call_block_is_exact() -> None:
    """A block the renderer itself produced canonically parses into calls that replay to it."""
    block = (
        "\n\n" + '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    memory = ToolMemory()
    memory.remember("call_1", block)
    from ds4_vllm.chat.dsml import replayed_dsml

    assert replayed_dsml([RenderCall("call_1", "f", "{}")], ServingState(tool_memory=memory).replay) == block
    assert replayed_dsml([RenderCall("call_2", "f", "{}")], ServingState(tool_memory=memory).replay) is None


def test_tool_parser_alone_streams_the_same(tokenizer, memory) -> None:
    """Without a reasoning parser vLLM feeds only deltas; the result is the same."""
    register_parsers()
    alone = ParserManager.get_parser(tool_parser_name="ds4", enable_auto_tools=True)
    request = _prepared(alone, tokenizer)
    whole = alone(tokenizer, request.tools).parse(ANSWER, request, enable_auto_tools=True)
    _, content, calls = _stream(
        alone, tokenizer, request, ANSWER, list(range(3, len(ANSWER), 7)), thinking=False
    )
    assert content == whole[1] == "I will look."
    assert [(c.id, c.function.arguments) for c in calls] == [(c.id, c.arguments) for c in whole[2]]
