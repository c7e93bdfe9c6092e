"""OpenAI /v1/responses requests -> the engine's prompt (`parse_responses_request`).

`input` is a list of typed items; each is read into a `ResponsesItem` (every field checked, as the
engine reads them) and added to the conversation by the handler its `type` names in `_ITEMS`.
Reasoning items wait for the assistant turn they belong to: the next assistant message or tool
call takes them, any other item first closes them as an assistant message of their own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from .fields import RenderError, array_value, cstr, load_request, object_value, opt_str_field, str_field
from .json_text import raw_text
from .messages import ChatMessage, Replay, ToolCall
from .template import RenderedPrompt, rendered_chat
from .thinking import RESPONSES_THINKING, resolve_think_mode
from .tool_schemas import request_tool_schemas, tool_schema_lines

_TEXT_BLOCK_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
#: Hosted tool calls and the function name each renders as (the item type when not listed).
_HOSTED_CALLS = ("local_shell_call", "web_search_call", "tool_search_call", "image_generation_call")
_HOSTED_CALL_NAMES = {"tool_search_call": "tool_search", "local_shell_call": "local_shell"}
_HOSTED_OUTPUTS = (
    "local_shell_call_output",
    "web_search_call_output",
    "tool_search_output",
    "tool_search_call_output",
    "image_generation_call_output",
)
_MISSING = object()


def render_responses(
    request: Mapping | bytes | str,
    *,
    ctx_size: int,
    tools_json: bytes | str | None = None,
    replay: Replay | None = None,
    vllm_switch: bool | None = None,
) -> RenderedPrompt:
    """/v1/responses: `instructions` become the first system message; schemas from replayed
    `tool_search_output` items follow the request's tools."""
    body = load_request(request, "Responses")
    if "input" not in body:
        raise RenderError("missing input")
    messages, loaded = responses_input(body["input"])
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise RenderError(f"{key} is not supported; replay full input instead")
    instructions = body.get("instructions")
    if instructions is not None:
        instructions = str_field(body, "instructions", "body")
        if instructions:
            messages.insert(0, ChatMessage("system", instructions))
    choice = body.get("tool_choice")
    choice_none = False
    if isinstance(choice, str):
        if cstr(choice) == "none":
            choice_none = True
        elif cstr(choice) != "auto":
            raise RenderError(f"tool_choice={choice} not supported")
    elif isinstance(choice, Mapping):
        raise RenderError("forced tool_choice not supported")
    schemas = "\n".join(s for s in (request_tool_schemas(body, tools_json), "\n".join(loaded)) if s)
    think_mode = resolve_think_mode(body, RESPONSES_THINKING, ctx_size=ctx_size, vllm_switch=vllm_switch)
    return rendered_chat(
        messages,
        schemas,
        tools_active=not choice_none and bool(schemas),
        think_mode=think_mode,
        replay=replay,
    )


def responses_content(value: Any, path: str) -> str:
    """Responses content: a string, null, or an array of strings and typed text blocks; anything
    else is refused (`parse_responses_content_array`)."""
    if isinstance(value, str):
        return cstr(value)
    if value is None:
        return ""
    parts: list[str] = []
    for i, part in enumerate(array_value(value, path)):
        if isinstance(part, str):
            parts.append(cstr(part))
            continue
        where = f"{path}[{i}]"
        if not isinstance(part, Mapping):
            raise RenderError(f"{where}: expected a string or a text block")
        kind = opt_str_field(part, "type", where)
        if "text" in part and part["text"] is not None:
            text = str_field(part, "text", where)
        else:
            text = "" if "text" in part else None
        if kind not in _TEXT_BLOCK_TYPES or text is None:
            raise RenderError(f"{where}: not a text block (type {kind!r})")
        parts.append(text)
    return "".join(parts)


def responses_input(value: Any, path: str = "input") -> tuple[list[ChatMessage], list[str]]:
    """Responses `input` items -> (`ChatMessage`s, schema lines loaded from `tool_search_output`
    items) (`parse_responses_input`)."""
    if isinstance(value, str):
        return [ChatMessage("user", cstr(value))], []
    transcript = _Transcript()
    for i, raw in enumerate(array_value(value, path)):
        item = ResponsesItem.read(raw, f"{path}[{i}]")
        add = _ITEMS.get(item.kind)
        if add is None:
            raise RenderError(f"{item.where}.type: unsupported input item type {item.kind!r}")
        add(item, transcript)
    transcript.end_reasoning()
    return transcript.messages, transcript.loaded


def _first(*values: str | None) -> str:
    """The first value present (None: absent); the last argument is the default."""
    return next(v for v in values if v is not None)


@dataclasses.dataclass(frozen=True, slots=True)
class ResponsesItem:
    """One `input` item's fields as the engine reads them (None: absent)."""

    where: str
    kind: str
    role: str | None = None
    name: str | None = None
    namespace: str | None = None
    call_id: str = ""  # `call_id`, else `id`
    content: str | None = None
    summary: str | None = None
    arguments: str | None = None
    input: str | None = None
    result: str | None = None
    output: str | None = None
    action: str | None = None
    tools: Any = _MISSING  # the parsed `tools` of a hosted tool output

    @classmethod
    def read(cls, raw: Any, where: str) -> ResponsesItem:
        """Every field checked, in the engine's order; a replayed item must be completed."""
        item = object_value(raw, where)
        keys = ("type", "role", "name", "namespace", "call_id", "id")
        strings = {k: str_field(item, k, where) for k in keys if k in item}
        status = opt_str_field(item, "status", where)
        texts = {k: responses_content(item[k], f"{where}.{k}") for k in ("content", "summary") if k in item}
        values = {k: _str_or_raw(item[k]) for k in ("arguments", "input", "result") if k in item}
        if "output" in item:
            out = item["output"]
            is_array = isinstance(out, list | tuple)
            values["output"] = responses_content(out, f"{where}.output") if is_array else _str_or_raw(out)
        action = raw_text(item["action"]) if "action" in item else None
        if status and status != "completed":
            raise RenderError(f"{where}.status: replayed items must be completed, not {status!r}")
        return cls(
            where=where,
            kind=strings.get("type") or "message",
            role=strings.get("role"),
            name=strings.get("name"),
            namespace=strings.get("namespace"),
            call_id=_first(strings.get("call_id"), strings.get("id"), ""),
            action=action,
            tools=item.get("tools", _MISSING),
            **texts,
            **values,
        )


def _str_or_raw(value: Any) -> str:
    return cstr(value) if isinstance(value, str) else raw_text(value)


@dataclasses.dataclass(slots=True)
class _Transcript:
    """The conversation being built, and the reasoning waiting for its assistant turn."""

    messages: list[ChatMessage] = dataclasses.field(default_factory=list)
    loaded: list[str] = dataclasses.field(default_factory=list)  # schemas of tool_search outputs
    reasoning: str = ""  # "" when none is waiting

    def end_reasoning(self) -> None:
        """Waiting reasoning becomes an assistant message of its own."""
        if self.reasoning:
            self.messages.append(ChatMessage("assistant", "", self.reasoning))
            self.reasoning = ""

    def take_reasoning(self) -> str:
        reasoning, self.reasoning = self.reasoning, ""
        return reasoning

    def add_call(self, call: ToolCall) -> None:
        """A call joins the previous assistant message when nothing came between, else starts one."""
        last = self.messages[-1] if self.messages else None
        if last is not None and last.role == "assistant":
            if not last.reasoning:
                last.reasoning = self.take_reasoning()
            last.tool_calls.append(call)
        else:
            self.messages.append(ChatMessage("assistant", "", self.take_reasoning(), [call]))


def _message(item: ResponsesItem, t: _Transcript) -> None:
    msg = ChatMessage(item.role or "user", item.content or "")
    if msg.role == "assistant":
        msg.reasoning = t.take_reasoning()
    else:
        t.end_reasoning()
    t.messages.append(msg)


def _function_call(item: ResponsesItem, t: _Transcript) -> None:
    name = item.name or ""
    if item.kind != "custom_tool_call" and item.namespace and name:
        name = item.namespace + name
    t.add_call(ToolCall(item.call_id, name, _first(item.arguments, item.input, "{}")))


def _function_output(item: ResponsesItem, t: _Transcript) -> None:
    t.end_reasoning()
    t.messages.append(ChatMessage("tool", item.output or ""))


def _reasoning(item: ResponsesItem, t: _Transcript) -> None:
    t.end_reasoning()  # each reasoning item is one turn's reasoning: summary, then content
    for text in (item.summary, item.content):
        if text:
            t.reasoning = t.reasoning + "\n" + text if t.reasoning else text


def _hosted_call(item: ResponsesItem, t: _Transcript) -> None:
    name = _HOSTED_CALL_NAMES.get(item.kind, item.kind)
    t.add_call(ToolCall(item.call_id, name, _first(item.action, item.arguments, item.input, "{}")))


def _hosted_output(item: ResponsesItem, t: _Transcript) -> None:
    t.end_reasoning()
    tools_raw = ""
    if item.tools is not _MISSING:
        tools_raw = raw_text(item.tools)
        if item.kind == "tool_search_output":
            t.loaded.extend(tool_schema_lines(item.tools, path=f"{item.where}.tools"))
    t.messages.append(ChatMessage("tool", _first(item.output, item.result, tools_raw)))


def _bookkeeping(item: ResponsesItem, t: _Transcript) -> None:
    """Compaction markers render nothing, and leave waiting reasoning waiting."""


#: Item type -> how it joins the conversation.
_ITEMS: dict[str, Callable[[ResponsesItem, _Transcript], None]] = {
    "message": _message,
    "function_call": _function_call,
    "custom_tool_call": _function_call,
    "function_call_output": _function_output,
    "custom_tool_call_output": _function_output,
    "reasoning": _reasoning,
    **dict.fromkeys(_HOSTED_CALLS, _hosted_call),
    **dict.fromkeys(_HOSTED_OUTPUTS, _hosted_output),
    "compaction": _bookkeeping,
    "context_compaction": _bookkeeping,
}
