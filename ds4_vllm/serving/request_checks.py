"""Tool-call history a client can get wrong, refused with HTTP 400 before anything is rendered.

The ds4 engine renders whatever history it gets: arguments that are not JSON become one string
parameter, and a tool result answering no call is rendered as any other. vLLM's own chat path
turns bad arguments into `{}`. Both hide a client bug and put a prompt into the cache that no
well-formed conversation will ever extend. The OpenAI and Anthropic APIs refuse such requests,
and so does this server, naming the field:

- an assistant tool call whose `arguments` string is not JSON (chat `tool_calls[].function`,
  Responses `function_call` items); an empty string still means "no arguments";
- a tool result that answers no earlier call (chat `tool` messages' `tool_call_id`, Anthropic
  `tool_result` blocks' `tool_use_id`, Responses `function_call_output` items' `call_id`).

An id the server does not remember is not an error: it is rendered canonically (see
`ds4_vllm.serving.tool_replay`); only the client's own history must be consistent.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ds4_vllm.chat.fields import RenderError

from .request_body import Route


def check_tool_history(route: Route, body: Mapping) -> None:
    """Raise `RenderError` naming the field when the body's tool-call history is inconsistent."""
    if route is Route.CHAT:
        _check_chat(body.get("messages"))
    elif route is Route.ANTHROPIC:
        _check_anthropic(body.get("messages"))
    elif route is Route.RESPONSES:
        _check_responses(body.get("input"))


def _check_arguments(arguments: Any, where: str) -> None:
    if not isinstance(arguments, str) or not arguments.strip():
        return  # a JSON value as is, or no arguments at all
    try:
        json.loads(arguments)
    except ValueError as exc:
        raise RenderError(f"{where}: not valid JSON ({exc})") from None


def _unanswerable(where: str, key: str, tool_id: str, calls: str) -> RenderError:
    return RenderError(f"{where}.{key}: {tool_id!r} answers no tool call of an earlier {calls}")


def _check_chat(messages: Any) -> None:
    if not isinstance(messages, list):
        return  # the renderer names what is wrong with `messages` itself
    call_ids: set[str] = set()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            continue
        where = f"messages[{i}]"
        role = message.get("role")
        calls = message.get("tool_calls") if role == "assistant" else None
        for j, call in enumerate(calls if isinstance(calls, list) else ()):
            if not isinstance(call, Mapping):
                continue
            if isinstance(call.get("id"), str):
                call_ids.add(call["id"])
            function = call.get("function")
            if isinstance(function, Mapping) and "arguments" in function:
                _check_arguments(function["arguments"], f"{where}.tool_calls[{j}].function.arguments")
        tool_id = message.get("tool_call_id")
        if role == "tool" and isinstance(tool_id, str) and tool_id not in call_ids:
            raise _unanswerable(where, "tool_call_id", tool_id, "assistant message")


def _check_anthropic(messages: Any) -> None:
    if not isinstance(messages, list):
        return
    use_ids: set[str] = set()
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, block in enumerate(content if isinstance(content, list) else ()):
            if not isinstance(block, Mapping):
                continue
            kind, where = block.get("type"), f"messages[{i}].content[{j}]"
            if kind == "tool_use" and isinstance(block.get("id"), str):
                use_ids.add(block["id"])
            elif kind == "tool_result" and isinstance(block.get("tool_use_id"), str):
                if block["tool_use_id"] not in use_ids:
                    raise _unanswerable(where, "tool_use_id", block["tool_use_id"], "tool_use block")


def _check_responses(items: Any) -> None:
    if not isinstance(items, list):
        return  # a plain text input has no history
    call_ids: set[str] = set()
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            continue
        kind, where = item.get("type"), f"input[{i}]"
        if kind == "function_call":
            call_ids.update(v for v in (item.get("call_id"), item.get("id")) if isinstance(v, str))
            if "arguments" in item:
                _check_arguments(item["arguments"], f"{where}.arguments")
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            if item["call_id"] not in call_ids:
                raise _unanswerable(where, "call_id", item["call_id"], "function_call item")
