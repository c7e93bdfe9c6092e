"""Anthropic /v1/messages requests -> the engine's prompt (`parse_anthropic_request`)."""

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
from .template import TOOL_RESULT_CLOSE, TOOL_RESULT_OPEN, RenderedPrompt, escape_tool_result, rendered_chat
from .thinking import ANTHROPIC_THINKING, resolve_think_mode
from .tool_schemas import request_tool_schemas

_MISSING = object()


def render_anthropic_messages(
    request: Mapping | bytes | str,
    *,
    ctx_size: int,
    tools_json: bytes | str | None = None,
    replay: Replay | None = None,
    vllm_switch: bool | None = None,
) -> RenderedPrompt:
    """/v1/messages; `system` becomes the last system message."""
    body = load_request(request, "Anthropic messages")
    if "messages" not in body:
        raise RenderError("missing messages")
    messages = anthropic_messages(body["messages"])
    system = anthropic_system(body.get("system"))
    if system:
        messages.append(ChatMessage(role="system", content=system))
    schemas = request_tool_schemas(body, tools_json)
    choice = body.get("tool_choice")
    choice_none = (
        isinstance(choice, Mapping)
        and "type" in choice
        and str_field(choice, "type", "tool_choice") == "none"
    )
    think_mode = resolve_think_mode(body, ANTHROPIC_THINKING, ctx_size=ctx_size, vllm_switch=vllm_switch)
    return rendered_chat(
        messages,
        schemas,
        tools_active=bool(schemas) and not choice_none,
        think_mode=think_mode,
        replay=replay,
    )


def anthropic_messages(value: Any, path: str = "messages") -> list[ChatMessage]:
    """Anthropic `messages` -> `ChatMessage`s: text/thinking folded into strings, tool_use into
    tool calls, tool_result into `<tool_result>` text (`parse_anthropic_messages`)."""
    out: list[ChatMessage] = []
    for i, raw in enumerate(array_value(value, path)):
        where = f"{path}[{i}]"
        m = object_value(raw, where)
        role = opt_str_field(m, "role", where)
        msg = ChatMessage(role="user" if role is None else role)
        content = m.get("content")
        if isinstance(content, str):
            msg.content = cstr(content)
        elif isinstance(content, list | tuple):
            for j, part in enumerate(content):
                if isinstance(part, str):
                    msg.content += cstr(part)
                elif isinstance(part, Mapping):
                    _add_block(part, msg, f"{where}.content[{j}]")
        out.append(msg)
    return out


def anthropic_system(value: Any, path: str = "system") -> str:
    """Top-level `system`: parts joined with "\\n" (none after a part ending in one); empty and
    `x-anthropic-*` parts dropped."""
    parts: list[str] = []
    if isinstance(value, str):
        parts.append(cstr(value))
    elif isinstance(value, list | tuple):
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(cstr(part))
            elif isinstance(part, Mapping) and "text" in part:
                parts.append(str_field(part, "text", f"{path}[{i}]"))
    text = ""
    for part in parts:
        if not part or part.startswith("x-anthropic-"):
            continue
        if text and not text.endswith("\n"):
            text += "\n"
        text += part
    return text


def _add_block(block: Mapping, msg: ChatMessage, path: str) -> None:
    """One content block into `msg`: tool_use a call, tool_result wrapped text, others text/thinking."""
    kind = opt_str_field(block, "type", path)
    text = thinking = result = None
    block_id = name = None
    tool_input = _MISSING
    for key in block:  # in object order: for id/tool_use_id the later one wins
        if key == "text":
            text = json_content(block[key], f"{path}.text")
        elif key == "thinking":
            thinking = json_content(block[key], f"{path}.thinking")
        elif key in ("id", "tool_use_id"):
            block_id = str_field(block, key, path)
        elif key == "name":
            name = str_field(block, key, path)
        elif key == "input":
            tool_input = block[key]
        elif key == "content":
            result = json_content(block[key], f"{path}.content")
    if kind == "tool_use":
        arguments = raw_text(tool_input) if tool_input is not _MISSING else "{}"
        msg.tool_calls.append(ToolCall(block_id, name or "", arguments))
    elif kind == "tool_result":
        msg.content += TOOL_RESULT_OPEN + escape_tool_result(result or "") + TOOL_RESULT_CLOSE
    else:
        if text:
            msg.content += text
        if thinking:
            msg.reasoning += thinking
