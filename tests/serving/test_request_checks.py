"""`check_tool_history`: inconsistent tool-call history is refused naming the field; good history passes."""

from __future__ import annotations

import pytest

from ds4_vllm.chat.fields import RenderError
from ds4_vllm.serving.request_body import Route
from ds4_vllm.serving.request_checks import check_tool_history


def chat_call(call_id: str, arguments) -> dict:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "f", "arguments": arguments}}
        ],
    }


GOOD_CHAT = [
    {"role": "user", "content": "hi"},
    chat_call("call_1", '{"a": 1}'),
    {"role": "tool", "tool_call_id": "call_1", "content": "r"},
    chat_call("call_2", ""),  # no arguments
    chat_call("call_3", {"a": [1]}),  # a JSON value, not a string
    chat_call("call_4", "[1, 2]"),  # JSON, not an object: rendered as the engine does
    {"role": "tool", "tool_call_id": "call_2", "content": "r"},
    {"role": "tool", "content": "no id"},
]


def test_consistent_history_passes_on_every_route() -> None:
    check_tool_history(Route.CHAT, {"messages": GOOD_CHAT})
    check_tool_history(
        Route.ANTHROPIC,
        {
            "messages": [
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "r"}],
                },
            ]
        },
    )
    check_tool_history(
        Route.RESPONSES,
        {
            "input": [
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
            ]
        },
    )
    check_tool_history(Route.RESPONSES, {"input": "plain text"})
    check_tool_history(Route.COMPLETION, {"prompt": "x"})


@pytest.mark.parametrize(
    ("route", "body", "message"),
    [
        (
            Route.CHAT,
            {"messages": [{"role": "user", "content": "hi"}, chat_call("call_1", '{"a": 1,}')]},
            "messages[1].tool_calls[0].function.arguments: not valid JSON (Expecting property name "
            "enclosed in double quotes: line 1 column 9 (char 8))",
        ),
        (
            Route.CHAT,
            {"messages": [*GOOD_CHAT, {"role": "tool", "tool_call_id": "call_9", "content": "r"}]},
            "messages[8].tool_call_id: 'call_9' answers no tool call of an earlier assistant message",
        ),
        (
            Route.CHAT,  # the answer comes before the call
            {
                "messages": [
                    {"role": "tool", "tool_call_id": "call_1", "content": "r"},
                    chat_call("call_1", "{}"),
                ]
            },
            "messages[0].tool_call_id: 'call_1' answers no tool call of an earlier assistant message",
        ),
        (
            Route.ANTHROPIC,
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
            "messages[0].content[0].tool_use_id: 'toolu_x' answers no tool call of an earlier tool_use block",
        ),
        (
            Route.RESPONSES,
            {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}]},
            "input[0].arguments: not valid JSON (Expecting property name enclosed in double quotes: "
            "line 1 column 2 (char 1))",
        ),
        (
            Route.RESPONSES,
            {"input": [{"type": "function_call_output", "call_id": "c2", "output": "r"}]},
            "input[0].call_id: 'c2' answers no tool call of an earlier function_call item",
        ),
    ],
)
def test_inconsistent_history_is_refused_naming_the_field(route, body, message) -> None:
    with pytest.raises(RenderError) as error:
        check_tool_history(route, body)
    assert str(error.value) == message
