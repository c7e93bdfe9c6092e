"""OpenAI /v1/chat/completions requests -> the engine's prompt (`parse_chat_request`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .fields import (
    RenderError,
    array_value,
    cstr,
    json_content,
    load_request,
    object_value,
    opt_str_field,
    str_field,
)
from .json_text import raw_text
from .messages import ChatMessage, Replay, ToolCall
from .template import RenderedPrompt, rendered_chat
from .thinking import CHAT_THINKING, resolve_think_mode
from .tool_schemas import request_tool_schemas


def render_chat_completion(
    request: Mapping | bytes | str,
    *,
    ctx_size: int,
    tools_json: bytes | str | None = None,
    replay: Replay | None = None,
    vllm_switch: bool | None = None,
) -> RenderedPrompt:
    """/v1/chat/completions. `request` is the raw body (best: every byte kept) or parsed JSON; see
    `ds4_vllm.chat` for `tools_json` and `replay`, `ds4_vllm.chat.thinking` for `vllm_switch`."""
    body = load_request(request, "chat completion")
    if "messages" not in body:
        raise RenderError("missing messages")
    messages = openai_messages(body["messages"])
    schemas = request_tool_schemas(body, tools_json)
    choice = body.get("tool_choice")
    tools_active = bool(schemas) and not (isinstance(choice, str) and cstr(choice) == "none")
    think_mode = resolve_think_mode(body, CHAT_THINKING, ctx_size=ctx_size, vllm_switch=vllm_switch)
    return rendered_chat(messages, schemas, tools_active=tools_active, think_mode=think_mode, replay=replay)


def openai_messages(value: Any, path: str = "messages") -> list[ChatMessage]:
    """Chat-completions `messages` -> `ChatMessage`s (`parse_messages`)."""
    out: list[ChatMessage] = []
    for i, raw in enumerate(array_value(value, path)):
        where = f"{path}[{i}]"
        m = object_value(raw, where)
        role = opt_str_field(m, "role", where)
        msg = ChatMessage(role="user" if role is None else role)
        if "content" in m:
            msg.content = json_content(m["content"], f"{where}.content")
        if "reasoning_content" in m:
            msg.reasoning = json_content(m["reasoning_content"], f"{where}.reasoning_content")
        if "tool_call_id" in m:
            str_field(m, "tool_call_id", where)
        if "tool_calls" in m:
            msg.tool_calls = _openai_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def _openai_tool_calls(value: Any, path: str) -> list[ToolCall]:
    if value is None:
        return []
    calls: list[ToolCall] = []
    for i, item in enumerate(array_value(value, path)):
        item = object_value(item, f"{path}[{i}]")
        call_id = opt_str_field(item, "id", f"{path}[{i}]")
        name = arguments = None
        if "function" in item:
            fn = object_value(item["function"], f"{path}[{i}].function")
            name = opt_str_field(fn, "name", f"{path}[{i}].function")
            if "arguments" in fn:
                args = fn["arguments"]
                arguments = cstr(args) if isinstance(args, str) else raw_text(args)
        if name is not None and arguments is not None:  # the engine drops incomplete calls
            calls.append(ToolCall(call_id, name, arguments))
    return calls
