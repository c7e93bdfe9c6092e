"""Prompt text exactly as the ds4 engine renders it (shared/specs/kvc-format.md §8).

The rendered text is the disk-cache key: one byte of difference and an engine checkpoint is never
found. So every rule here is the engine's, including its quirks (raw tool-schema bytes, DSML
escaping, when old reasoning is kept). Entry points, one per API:

- `render_chat_completion`  OpenAI /v1/chat/completions
- `render_anthropic_messages`  Anthropic /v1/messages
- `render_responses`  OpenAI /v1/responses
- `render_completion`  /v1/completions
- `render_messages`  the shared §8.1 template over already converted `ChatMessage`s

Each request argument is either the raw request body (bytes/str: best, every raw byte is kept) or
the parsed JSON as plain Python values. With parsed values, pass `tools_json` (the raw bytes of the
request's `tools` array) to keep the client's schema formatting; otherwise compact JSON is assumed.
`replay(tool_call_id)` may return the exact DSML block the model sampled for that call (the
engine's tool memory and KTM trailers): an assistant turn whose call ids all map to one same block
is rendered with those bytes verbatim, others canonically.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .dsml import parse_tool_calls
from .json_text import (
    JsonTextError,
    json_string,
    minify,
    parse_json,
    raw_text,
    read_string,
    skip_space,
    skip_value,
)
from .tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER

#: Returns the exact sampled DSML block for a tool-call id, or None when unknown.
Replay = Callable[[str], str | None]

THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve "
    "the root cause, rigorously stress-testing your logic against all potential paths, edge cases, "
    "and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
#: Max effort only injects THINK_MAX_PREFIX with at least this context (`DS4_THINK_MAX_MIN_CONTEXT`).
THINK_MAX_MIN_CONTEXT = 393216

TOOLS_PREAMBLE = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. "
    'You can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as raw text and set `string="true"`. '
    "Preserve characters such as `>`, `&`, and `&&` exactly; never replace normal string characters "
    "with XML or HTML entity escapes. "
    "Only if a string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, "
    "write that tag as `&lt;/｜DSML｜parameter>` inside the value. "
    "For all other types (numbers, booleans, arrays, objects), pass the value in JSON format and "
    'set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning "
    "inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_POSTAMBLE = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls. Use the exact parameter names from the schemas."
)
COMPLETION_SYSTEM = "You are a helpful assistant"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"
DSML_PARAMETER_CLOSE = "</｜DSML｜parameter>"


class RenderError(ValueError):
    """A request the engine refuses (it answers HTTP 400); the message names the field."""


class ThinkMode(enum.Enum):
    NONE = "none"
    HIGH = "high"
    MAX = "max"

    @property
    def enabled(self) -> bool:
        return self is not ThinkMode.NONE


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """An assistant tool call. `arguments` is JSON text: the string the client sent, or the raw
    text of a non-string value."""

    id: str | None
    name: str
    arguments: str


@dataclasses.dataclass(slots=True)
class ChatMessage:
    """One message after conversion from any API (the engine's `chat_msg`)."""

    role: str
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """The engine's `prompt_text` for a request and what it was decided from."""

    text: str
    think_mode: ThinkMode
    #: The SCHEMAS text the tools block was built from ("" when tools are absent or off).
    tool_schemas: str
    messages: tuple[ChatMessage, ...]

    @property
    def text_bytes(self) -> bytes:
        """UTF-8 bytes, lone surrogates from \\u escapes kept as the engine writes them."""
        return self.text.encode("utf-8", "surrogatepass")

    @property
    def has_tools(self) -> bool:
        return bool(self.tool_schemas)


# -- thinking -----------------------------------------------------------------------------------

_EFFORTS = {
    "max": ThinkMode.MAX,
    "xhigh": ThinkMode.HIGH,
    "high": ThinkMode.HIGH,
    "medium": ThinkMode.HIGH,
    "low": ThinkMode.HIGH,
    "minimal": ThinkMode.HIGH,
    "none": ThinkMode.NONE,
}


def parse_effort(value: Any, field: str) -> ThinkMode | None:
    """A reasoning effort name (None for JSON null); unknown names are refused."""
    if value is None:
        return None
    if not isinstance(value, str) or _cstr(value) not in _EFFORTS:
        raise RenderError(f"{field}: unknown reasoning effort {value!r}")
    return _EFFORTS[_cstr(value)]


def think_mode_for(*, enabled: bool = True, effort: ThinkMode = ThinkMode.HIGH, ctx_size: int) -> ThinkMode:
    """The engine's think mode: off when disabled or effort none; max only with a big enough context."""
    if not enabled or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    if effort is ThinkMode.MAX:
        return ThinkMode.MAX if max(ctx_size, 0) >= THINK_MAX_MIN_CONTEXT else ThinkMode.HIGH
    return ThinkMode.HIGH


def _thinking_control(value: Any, enabled: bool, field: str) -> bool:
    """`thinking`: true/false, or {"type": "enabled"|"disabled"}; anything else leaves it as is."""
    if isinstance(value, bool):
        return value
    if isinstance(value, Mapping) and "type" in value:
        kind = _str(value, "type", field)
        if kind == "enabled":
            return True
        if kind == "disabled":
            return False
    return enabled


def _vllm_thinking(
    body: Mapping, enabled: bool, got_thinking: bool, effort: ThinkMode
) -> tuple[bool, bool, ThinkMode]:
    """vLLM's spelling, `chat_template_kwargs` {"thinking" | "enable_thinking": bool,
    "reasoning_effort": name}, read first: the engine's own fields, read after it, win."""
    kwargs = body.get("chat_template_kwargs")
    if not isinstance(kwargs, Mapping):
        return enabled, got_thinking, effort
    for key in ("enable_thinking", "thinking"):
        if isinstance(kwargs.get(key), bool):
            enabled, got_thinking = kwargs[key], True
    if kwargs.get("reasoning_effort") is not None:
        effort = parse_effort(kwargs["reasoning_effort"], "chat_template_kwargs.reasoning_effort") or effort
        if effort is ThinkMode.NONE:
            enabled, got_thinking = False, True
    return enabled, got_thinking, effort


def _apply_model_alias(model: Any, got_thinking: bool, enabled: bool) -> bool:
    if got_thinking or not isinstance(model, str):
        return enabled
    if _cstr(model) == "deepseek-chat":
        return False
    if _cstr(model) == "deepseek-reasoner":
        return True
    return enabled


# -- small readers ------------------------------------------------------------------------------


def _cstr(s: str) -> str:
    """The engine keeps strings as C strings: text after a NUL is gone."""
    return s.split("\0", 1)[0]


def _str(obj: Mapping, key: str, path: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise RenderError(f"{path}.{key}: expected a string, got {type(value).__name__}")
    return _cstr(value)


def _opt_str(obj: Mapping, key: str, path: str) -> str | None:
    return _str(obj, key, path) if key in obj else None


def _object(value: Any, path: str) -> Mapping:
    if not isinstance(value, Mapping):
        raise RenderError(f"{path}: expected an object, got {type(value).__name__}")
    return value


def _array(value: Any, path: str) -> Sequence:
    if not isinstance(value, list | tuple):
        raise RenderError(f"{path}: expected an array, got {type(value).__name__}")
    return value


def _load_request(request: Mapping | bytes | str, what: str) -> Mapping:
    if isinstance(request, bytes | bytearray | memoryview | str):
        try:
            request = parse_json(request)
        except JsonTextError as exc:
            raise RenderError(f"{what} body: {exc}") from None
    return _object(request, f"{what} body")


def json_content(value: Any, path: str) -> str:
    """Message content (`json_content`): a string, or the concatenated strings and `text` fields
    of an array; null and other values give ""."""
    if isinstance(value, str):
        return _cstr(value)
    if not isinstance(value, list | tuple):
        return ""
    parts: list[str] = []
    for i, part in enumerate(value):
        if isinstance(part, str):
            parts.append(_cstr(part))
        elif isinstance(part, Mapping) and "text" in part:
            parts.append(_str(part, "text", f"{path}[{i}]"))
    return "".join(parts)


def json_escape(s: str) -> str:
    """The engine's JSON string writer over its C string (text after a NUL is gone)."""
    return json_string(_cstr(s))


# -- tools --------------------------------------------------------------------------------------

_DEFAULT_PARAMETERS = '{"type":"object","properties":{}}'


def tool_schema_lines(tools: Any, *, path: str = "tools") -> list[str]:
    """One schema JSON text per tool (`parse_tools_value`), from a parsed `tools` array."""
    if tools is None:
        return []
    lines: list[str] = []
    for i, tool in enumerate(_array(tools, path)):
        if isinstance(tool, Mapping) and "function" in tool:
            lines.append(raw_text(tool["function"]))  # OpenAI wrapper: the raw `function` value
            continue
        members = _namespace_member_schemas(tool, f"{path}[{i}]")
        if members:
            lines.extend(members)
            continue
        special = _tool_search_schema(tool, f"{path}[{i}]")
        lines.append(special if special is not None else raw_text(tool))
    return [line for line in lines if line]


def tool_schemas_text(tools: Any) -> str:
    """SCHEMAS of the tools block: the schema lines joined with "\\n". `tools` may be raw JSON."""
    if isinstance(tools, bytes | bytearray | memoryview | str):
        try:
            tools = parse_json(tools)
        except JsonTextError as exc:
            raise RenderError(f"tools: {exc}") from None
    return "\n".join(tool_schema_lines(tools))


def _namespace_member_schemas(tool: Any, path: str) -> list[str]:
    """Responses `type: "namespace"` tools: each function member re-serialized with `ns + name`."""
    if not isinstance(tool, Mapping):
        return []
    kind, name, members = tool.get("type"), tool.get("name"), tool.get("tools")
    if kind != "namespace" or not isinstance(name, str) or not isinstance(members, list | tuple):
        return []
    out: list[str] = []
    for member in members:
        if not isinstance(member, Mapping):
            continue
        m_type, m_name = member.get("type"), member.get("name")
        if m_type is not None and m_type != "function":
            continue
        if not isinstance(m_name, str) or not _cstr(m_name):
            continue
        description = member.get("description", "")
        if not isinstance(description, str):
            continue
        params = _last_present(member, ("parameters", "input_schema"))
        out.append(
            '{"name":'
            + json_escape(_cstr(name) + _cstr(m_name))
            + ',"description":'
            + json_escape(description)
            + ',"parameters":'
            + (raw_text(params) if params is not _MISSING else _DEFAULT_PARAMETERS)
            + "}"
        )
    return out


def _tool_search_schema(tool: Any, path: str) -> str | None:
    """The Responses hosted `tool_search` tool, re-serialized as a function schema."""
    if not isinstance(tool, Mapping) or tool.get("type") != "tool_search":
        return None
    description = tool.get("description", "Search available tools.")
    if not isinstance(description, str):
        return None
    params = tool.get("parameters", _MISSING)
    return (
        '{"name":"tool_search","description":'
        + json_escape(description)
        + ',"parameters":'
        + (raw_text(params) if params is not _MISSING else _DEFAULT_PARAMETERS)
        + "}"
    )


_MISSING = object()


def _last_present(obj: Mapping, keys: Sequence[str]) -> Any:
    """Value of whichever of `keys` came last in the object (the engine keeps the last one read)."""
    found = _MISSING
    for key in obj:
        if key in keys:
            found = obj[key]
    return found


def tools_block(schemas: str) -> str:
    """The tools section at the start of SYSTEM (`append_tools_prompt_text`); "" without schemas."""
    return TOOLS_PREAMBLE + schemas + TOOLS_POSTAMBLE if schemas else ""


# -- DSML ---------------------------------------------------------------------------------------


def _attr(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _parse_arguments(arguments: str) -> list[tuple[str, str, bool]] | None:
    """(key, value, is_string) per member of a JSON object text (`json_args_parse`); None when the
    text is not an object. String values are unescaped, others minified raw text."""
    text = _cstr(arguments)
    pos = skip_space(text, 0)
    if not text.startswith("{", pos):
        return None
    pos = skip_space(text, pos + 1)
    args: list[tuple[str, str, bool]] = []
    try:
        while pos < len(text) and text[pos] != "}":
            key, pos = read_string(text, pos)
            pos = skip_space(text, pos)
            if not text.startswith(":", pos):
                return None
            pos = skip_space(text, pos + 1)
            if text.startswith('"', pos):
                value, pos = read_string(text, pos)
                args.append((key, value, True))
            else:
                end = skip_value(text, pos)
                args.append((key, minify(text[pos:end]), False))
                pos = end
            pos = skip_space(text, pos)
            if text.startswith(",", pos):
                pos += 1
            pos = skip_space(text, pos)
    except JsonTextError:
        return None
    return args if text.startswith("}", pos) else None


def dsml_tool_calls(calls: Sequence[ToolCall]) -> str:
    """Canonical DSML for an assistant's tool calls (`append_dsml_tool_calls_text`)."""
    if not calls:
        return ""
    out = ["\n\n<｜DSML｜tool_calls>\n"]
    for call in calls:
        out.append(f'<｜DSML｜invoke name="{_attr(_cstr(call.name))}">\n')
        args = _parse_arguments(call.arguments)
        if args is None:
            out.append('<｜DSML｜parameter name="arguments" string="true">')
            out.append(_cstr(call.arguments).replace(DSML_PARAMETER_CLOSE, "&lt;" + DSML_PARAMETER_CLOSE[1:]))
            out.append(DSML_PARAMETER_CLOSE + "\n")
        else:
            for key, value, is_string in args:
                if is_string:
                    value = value.replace(DSML_PARAMETER_CLOSE, "&lt;" + DSML_PARAMETER_CLOSE[1:])
                else:
                    value = value.replace(DSML_PARAMETER_CLOSE, "\\u003c" + DSML_PARAMETER_CLOSE[1:])
                flag = "true" if is_string else "false"
                out.append(
                    f'<｜DSML｜parameter name="{_attr(key)}" string="{flag}">{value}{DSML_PARAMETER_CLOSE}\n'
                )
        out.append("</｜DSML｜invoke>\n")
    out.append("</｜DSML｜tool_calls>")
    return "".join(out)


def replayed_dsml(calls: Sequence[ToolCall], replay: Replay | None) -> str | None:
    """The remembered block when every call id maps to one same block (`tool_memory_attach_to_messages`)
    and that block holds the very calls the client sent back.

    The engine trusts the id alone. Here a block whose calls differ from the client's (other
    names, other arguments, another count) is not replayed: a client that edits a call, or names
    an id it did not receive with calls of its own, gets its own calls rendered canonically,
    never another conversation's sampled bytes.
    """
    if replay is None or not calls:
        return None
    blocks = {replay(call.id) if call.id else None for call in calls}
    if len(blocks) != 1:
        return None
    block = blocks.pop()
    return block if block and _block_holds(block, calls) else None


def _argument_texts(arguments: str) -> dict[str, str] | None:
    """Argument name -> value as text (strings as is, other values as sorted compact JSON)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return {
        k: v
        if isinstance(v, str)
        else json.dumps(v, separators=(",", ":"), sort_keys=True, ensure_ascii=False)
        for k, v in value.items()
    }


def _block_holds(block: str, calls: Sequence[ToolCall]) -> bool:
    """Whether a DSML block parses to these calls: same names in order and same argument values
    (compared as text: the legacy block forms do not say which values are strings)."""
    parsed = parse_tool_calls(block)
    if parsed.error is not None or len(parsed.calls) != len(calls):
        return False
    for sampled, sent in zip(parsed.calls, calls, strict=True):
        if sampled.name != sent.name:
            return False
        ours = _argument_texts(sampled.arguments)
        if ours is None or ours != _argument_texts(sent.arguments):
            return False
    return True


# -- §8.1 chat template -------------------------------------------------------------------------


def escape_tool_result(content: str) -> str:
    """Only the wrapper's own closing tag is escaped (its `<` becomes `&lt;`)."""
    return content.replace(TOOL_RESULT_CLOSE, "&lt;" + TOOL_RESULT_CLOSE[1:])


def _is_system(role: str) -> bool:
    return role in ("system", "developer")


def _is_user_like(role: str) -> bool:
    return role in ("user", "tool", "function")


def uses_tool_context(messages: Sequence[ChatMessage], tool_schemas: str) -> bool:
    """Tools active, or history with assistant tool calls or tool results: old reasoning is kept."""
    return bool(tool_schemas) or any(
        (m.role == "assistant" and m.tool_calls) or m.role in ("tool", "function") for m in messages
    )


def render_messages(
    messages: Sequence[ChatMessage],
    *,
    think_mode: ThinkMode,
    tool_schemas: str = "",
    replay: Replay | None = None,
) -> str:
    """The §8.1 template (`render_chat_prompt_text`). `tool_schemas` is "" when tools are inactive."""
    think = think_mode.enabled
    keep_all_reasoning = uses_tool_context(messages, tool_schemas)
    last_user = max((i for i, m in enumerate(messages) if _is_user_like(m.role)), default=-1)

    system = tools_block(tool_schemas)
    for m in messages:
        if _is_system(m.role):
            # The separator goes in only once SYSTEM is non-empty: an empty first part adds none.
            system += ("\n\n" if system else "") + m.content
    out = [BOS]
    if think_mode is ThinkMode.MAX:
        out.append(THINK_MAX_PREFIX)
    out.append(system)
    pending_assistant = pending_tool_result = False
    for i, m in enumerate(messages):
        if m.role == "user":
            out += [USER, m.content]
            pending_assistant, pending_tool_result = True, False
        elif m.role in ("tool", "function"):
            if not pending_tool_result:
                out.append(USER)
            out += [TOOL_RESULT_OPEN, escape_tool_result(m.content), TOOL_RESULT_CLOSE]
            pending_assistant = pending_tool_result = True
        elif m.role == "assistant":
            if pending_assistant:
                out.append(ASSISTANT)
                if think and (keep_all_reasoning or i > last_user):
                    out += [THINK_START, m.reasoning, THINK_END]
                else:
                    out.append(THINK_END)
            out.append(m.content)
            if m.tool_calls:
                replayed = replayed_dsml(m.tool_calls, replay)
                out.append(replayed if replayed is not None else dsml_tool_calls(m.tool_calls))
            out.append(EOS)
            pending_assistant = pending_tool_result = False
        # system/developer went into SYSTEM; other roles are not rendered
    if pending_assistant:
        out += [ASSISTANT, THINK_START if think else THINK_END]
    return "".join(out)


def _finish(
    messages: list[ChatMessage],
    schemas: str,
    tools_active: bool,
    think_mode: ThinkMode,
    replay: Replay | None,
) -> RenderedPrompt:
    active = schemas if tools_active else ""
    text = render_messages(messages, think_mode=think_mode, tool_schemas=active, replay=replay)
    return RenderedPrompt(text=text, think_mode=think_mode, tool_schemas=active, messages=tuple(messages))


def _request_tools(body: Mapping, tools_json: bytes | str | None) -> str:
    if tools_json is not None:
        return tool_schemas_text(tools_json)
    return "\n".join(tool_schema_lines(body["tools"])) if "tools" in body else ""


# -- OpenAI chat completions ----------------------------------------------------------------------


def _openai_tool_calls(value: Any, path: str) -> list[ToolCall]:
    if value is None:
        return []
    calls: list[ToolCall] = []
    for i, item in enumerate(_array(value, path)):
        item = _object(item, f"{path}[{i}]")
        call_id = _opt_str(item, "id", f"{path}[{i}]")
        name = arguments = None
        if "function" in item:
            fn = _object(item["function"], f"{path}[{i}].function")
            name = _opt_str(fn, "name", f"{path}[{i}].function")
            if "arguments" in fn:
                args = fn["arguments"]
                arguments = _cstr(args) if isinstance(args, str) else raw_text(args)
        if name is not None and arguments is not None:  # the engine drops incomplete calls
            calls.append(ToolCall(call_id, name, arguments))
    return calls


def openai_messages(value: Any, path: str = "messages") -> list[ChatMessage]:
    """Chat-completions `messages` -> `ChatMessage`s (`parse_messages`)."""
    out: list[ChatMessage] = []
    for i, raw in enumerate(_array(value, path)):
        where = f"{path}[{i}]"
        m = _object(raw, where)
        role = _opt_str(m, "role", where)
        msg = ChatMessage(role="user" if role is None else role)
        if "content" in m:
            msg.content = json_content(m["content"], f"{where}.content")
        if "reasoning_content" in m:
            msg.reasoning = json_content(m["reasoning_content"], f"{where}.reasoning_content")
        if "tool_call_id" in m:
            _str(m, "tool_call_id", where)
        if "tool_calls" in m:
            msg.tool_calls = _openai_tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(msg)
    return out


def _chat_think_mode(body: Mapping, ctx_size: int, *, allow_think_key: bool) -> ThinkMode:
    enabled, got_thinking, effort = _vllm_thinking(body, True, False, ThinkMode.HIGH)
    if "thinking" in body:
        enabled, got_thinking = _thinking_control(body["thinking"], enabled, "thinking"), True
    if allow_think_key and "think" in body:
        if not isinstance(body["think"], bool):
            raise RenderError("think: expected true or false")
        enabled, got_thinking = body["think"], True
    if "reasoning_effort" in body:
        effort = parse_effort(body["reasoning_effort"], "reasoning_effort") or effort
    enabled = _apply_model_alias(body.get("model"), got_thinking, enabled)
    return think_mode_for(enabled=enabled, effort=effort, ctx_size=ctx_size)


def render_chat_completion(
    request: Mapping | bytes | str,
    *,
    ctx_size: int,
    tools_json: bytes | str | None = None,
    replay: Replay | None = None,
) -> RenderedPrompt:
    """/v1/chat/completions (`parse_chat_request`)."""
    body = _load_request(request, "chat completion")
    if "messages" not in body:
        raise RenderError("missing messages")
    messages = openai_messages(body["messages"])
    schemas = _request_tools(body, tools_json)
    choice = body.get("tool_choice")
    tools_active = bool(schemas) and not (isinstance(choice, str) and _cstr(choice) == "none")
    think_mode = _chat_think_mode(body, ctx_size, allow_think_key=True)
    return _finish(messages, schemas, tools_active, think_mode, replay)


# -- Anthropic messages -------------------------------------------------------------------------


def _anthropic_block(block: Mapping, msg: ChatMessage, path: str) -> None:
    kind = _opt_str(block, "type", path)
    text = thinking = result = None
    block_id = name = None
    tool_input = _MISSING
    for key in block:  # in object order: for id/tool_use_id the later one wins
        if key == "text":
            text = json_content(block[key], f"{path}.text")
        elif key == "thinking":
            thinking = json_content(block[key], f"{path}.thinking")
        elif key in ("id", "tool_use_id"):
            block_id = _str(block, key, path)
        elif key == "name":
            name = _str(block, key, path)
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


def anthropic_messages(value: Any, path: str = "messages") -> list[ChatMessage]:
    """Anthropic `messages` -> `ChatMessage`s: text/thinking folded into strings, tool_use into
    tool calls, tool_result into `<tool_result>` text (`parse_anthropic_messages`)."""
    out: list[ChatMessage] = []
    for i, raw in enumerate(_array(value, path)):
        where = f"{path}[{i}]"
        m = _object(raw, where)
        role = _opt_str(m, "role", where)
        msg = ChatMessage(role="user" if role is None else role)
        content = m.get("content")
        if isinstance(content, str):
            msg.content = _cstr(content)
        elif isinstance(content, list | tuple):
            for j, part in enumerate(content):
                if isinstance(part, str):
                    msg.content += _cstr(part)
                elif isinstance(part, Mapping):
                    _anthropic_block(part, msg, f"{where}.content[{j}]")
        out.append(msg)
    return out


def anthropic_system(value: Any, path: str = "system") -> str:
    """Top-level `system`: parts joined with "\\n" (none after a part ending in one); empty and
    `x-anthropic-*` parts dropped."""
    parts: list[str] = []
    if isinstance(value, str):
        parts.append(_cstr(value))
    elif isinstance(value, list | tuple):
        for i, part in enumerate(value):
            if isinstance(part, str):
                parts.append(_cstr(part))
            elif isinstance(part, Mapping) and "text" in part:
                parts.append(_str(part, "text", f"{path}[{i}]"))
    text = ""
    for part in parts:
        if not part or part.startswith("x-anthropic-"):
            continue
        if text and not text.endswith("\n"):
            text += "\n"
        text += part
    return text


def render_anthropic_messages(
    request: Mapping | bytes | str,
    *,
    ctx_size: int,
    tools_json: bytes | str | None = None,
    replay: Replay | None = None,
) -> RenderedPrompt:
    """/v1/messages (`parse_anthropic_request`); `system` becomes the last system message."""
    body = _load_request(request, "Anthropic messages")
    if "messages" not in body:
        raise RenderError("missing messages")
    messages = anthropic_messages(body["messages"])
    system = anthropic_system(body.get("system"))
    if system:
        messages.append(ChatMessage(role="system", content=system))
    schemas = _request_tools(body, tools_json)
    choice = body.get("tool_choice")
    choice_none = (
        isinstance(choice, Mapping) and "type" in choice and _str(choice, "type", "tool_choice") == "none"
    )
    enabled, got_thinking, effort = _vllm_thinking(body, True, False, ThinkMode.HIGH)
    if "thinking" in body:
        enabled, got_thinking = _thinking_control(body["thinking"], enabled, "thinking"), True
    output_config = body.get("output_config")
    if isinstance(output_config, Mapping) and "effort" in output_config:
        effort = parse_effort(output_config["effort"], "output_config.effort") or effort
    if "reasoning_effort" in body:
        effort = parse_effort(body["reasoning_effort"], "reasoning_effort") or effort
    enabled = _apply_model_alias(body.get("model"), got_thinking, enabled)
    think_mode = think_mode_for(enabled=enabled, effort=effort, ctx_size=ctx_size)
    return _finish(messages, schemas, bool(schemas) and not choice_none, think_mode, replay)


# -- Responses ----------------------------------------------------------------------------------

_RESPONSES_TEXT_TYPES = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
_HOSTED_CALLS = ("local_shell_call", "web_search_call", "tool_search_call", "image_generation_call")
_HOSTED_OUTPUTS = (
    "local_shell_call_output",
    "web_search_call_output",
    "tool_search_output",
    "tool_search_call_output",
    "image_generation_call_output",
)


def responses_content(value: Any, path: str) -> str:
    """Responses content: a string, null, or an array of strings and typed text blocks; anything
    else is refused (`parse_responses_content_array`)."""
    if isinstance(value, str):
        return _cstr(value)
    if value is None:
        return ""
    parts: list[str] = []
    for i, part in enumerate(_array(value, path)):
        if isinstance(part, str):
            parts.append(_cstr(part))
            continue
        where = f"{path}[{i}]"
        if not isinstance(part, Mapping):
            raise RenderError(f"{where}: expected a string or a text block")
        kind = _opt_str(part, "type", where)
        if "text" in part and part["text"] is not None:
            text = _str(part, "text", where)
        else:
            text = "" if "text" in part else None
        if kind not in _RESPONSES_TEXT_TYPES or text is None:
            raise RenderError(f"{where}: not a text block (type {kind!r})")
        parts.append(text)
    return "".join(parts)


def _str_or_raw(value: Any) -> str:
    return _cstr(value) if isinstance(value, str) else raw_text(value)


def _attach_call(messages: list[ChatMessage], call: ToolCall, pending: list[str]) -> None:
    """Add a call to the previous assistant message when nothing came between, else a new one."""
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        if pending and not last.reasoning:
            last.reasoning = pending.pop()
        last.tool_calls.append(call)
    else:
        messages.append(ChatMessage("assistant", "", pending.pop() if pending else "", [call]))


def responses_input(value: Any, path: str = "input") -> tuple[list[ChatMessage], list[str]]:
    """Responses `input` items -> (`ChatMessage`s, schema lines loaded from `tool_search_output`
    items) (`parse_responses_input`)."""
    if isinstance(value, str):
        return [ChatMessage("user", _cstr(value))], []
    messages: list[ChatMessage] = []
    loaded: list[str] = []
    pending: list[str] = []  # holds at most one joined reasoning text
    for i, raw in enumerate(_array(value, path)):
        where = f"{path}[{i}]"
        item = _object(raw, where)
        f: dict[str, Any] = {}
        for key in ("type", "role", "name", "namespace", "call_id", "id", "status"):
            if key in item:
                f[key] = _str(item, key, where)
        for key in ("content", "summary"):
            if key in item:
                f[key] = responses_content(item[key], f"{where}.{key}")
        for key in ("arguments", "input", "result"):
            if key in item:
                f[key] = _str_or_raw(item[key])
        if "output" in item:
            out_value = item["output"]
            f["output"] = (
                responses_content(out_value, f"{where}.output")
                if isinstance(out_value, list | tuple)
                else _str_or_raw(out_value)
            )
        if "action" in item:
            f["action"] = raw_text(item["action"])
        if f.get("status") and f["status"] != "completed":
            raise RenderError(f"{where}.status: replayed items must be completed, not {f['status']!r}")
        kind = f.get("type") or "message"
        role = f.get("role")
        consumes = (kind == "message" and role == "assistant") or kind in (
            "function_call",
            "custom_tool_call",
            *_HOSTED_CALLS,
        )
        bookkeeping = kind in ("compaction", "context_compaction")
        if not consumes and not bookkeeping and pending:
            messages.append(ChatMessage("assistant", "", pending.pop()))
        call_id = f.get("call_id", f.get("id", ""))
        if kind == "message":
            msg = ChatMessage(role or "user", f.get("content", ""))
            if msg.role == "assistant" and pending:
                msg.reasoning = pending.pop()
            messages.append(msg)
        elif kind in ("function_call", "custom_tool_call"):
            arguments = f.get("arguments", f.get("input", "{}"))
            name = f.get("name") or ""
            if kind != "custom_tool_call" and f.get("namespace") and name:
                name = f["namespace"] + name
            _attach_call(messages, ToolCall(call_id, name, arguments), pending)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            messages.append(ChatMessage("tool", f.get("output", "")))
        elif kind == "reasoning":
            for text in (f.get("summary"), f.get("content")):
                if text:
                    pending[:] = [pending[0] + "\n" + text] if pending else [text]
        elif kind in _HOSTED_CALLS:
            name = {"tool_search_call": "tool_search", "local_shell_call": "local_shell"}.get(kind, kind)
            arguments = f.get("action", f.get("arguments", f.get("input", "{}")))
            _attach_call(messages, ToolCall(call_id, name, arguments), pending)
        elif kind in _HOSTED_OUTPUTS:
            tools_raw = ""
            if "tools" in item:
                tools_raw = raw_text(item["tools"])
                if kind == "tool_search_output":
                    loaded.extend(tool_schema_lines(item["tools"], path=f"{where}.tools"))
            body = f["output"] if "output" in f else f["result"] if "result" in f else tools_raw
            messages.append(ChatMessage("tool", body))
        elif not bookkeeping:
            raise RenderError(f"{where}.type: unsupported input item type {kind!r}")
    if pending:
        messages.append(ChatMessage("assistant", "", pending.pop()))
    return messages, loaded


def render_responses(
    request: Mapping | bytes | str,
    *,
    ctx_size: int,
    tools_json: bytes | str | None = None,
    replay: Replay | None = None,
) -> RenderedPrompt:
    """/v1/responses (`parse_responses_request`): `instructions` become the first system message;
    schemas from replayed `tool_search_output` items follow the request's tools."""
    body = _load_request(request, "Responses")
    if "input" not in body:
        raise RenderError("missing input")
    messages, loaded = responses_input(body["input"])
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise RenderError(f"{key} is not supported; replay full input instead")
    instructions = body.get("instructions")
    if instructions is not None:
        instructions = _str(body, "instructions", "body")
        if instructions:
            messages.insert(0, ChatMessage("system", instructions))
    choice = body.get("tool_choice")
    choice_none = False
    if isinstance(choice, str):
        if _cstr(choice) == "none":
            choice_none = True
        elif _cstr(choice) != "auto":
            raise RenderError(f"tool_choice={choice} not supported")
    elif isinstance(choice, Mapping):
        raise RenderError("forced tool_choice not supported")
    schemas = "\n".join(s for s in (_request_tools(body, tools_json), "\n".join(loaded)) if s)
    enabled, got_thinking, effort = _vllm_thinking(body, True, False, ThinkMode.HIGH)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, Mapping) and reasoning.get("effort") is not None:
        effort = parse_effort(reasoning["effort"], "reasoning.effort") or effort
        got_thinking = True
        if effort is ThinkMode.NONE:
            enabled = False
    enabled = _apply_model_alias(body.get("model"), got_thinking, enabled)
    think_mode = think_mode_for(enabled=enabled, effort=effort, ctx_size=ctx_size)
    return _finish(messages, schemas, not choice_none and bool(schemas), think_mode, replay)


# -- /v1/completions (§8.2) ---------------------------------------------------------------------


def completion_prompt_text(prompt: str, think_mode: ThinkMode) -> str:
    """The fixed wrapper around a /v1/completions prompt."""
    return (
        BOS
        + (THINK_MAX_PREFIX if think_mode is ThinkMode.MAX else "")
        + COMPLETION_SYSTEM
        + USER
        + _cstr(prompt)
        + ASSISTANT
        + (THINK_START if think_mode.enabled else THINK_END)
    )


def render_completion(request: Mapping | bytes | str, *, ctx_size: int) -> RenderedPrompt:
    """/v1/completions (`parse_completion_request`): `prompt` is a string, or an array whose first
    element is used when it is a string; any other value is the empty prompt."""
    body = _load_request(request, "completion")
    if "prompt" not in body:
        raise RenderError("missing prompt")
    value = body["prompt"]
    if isinstance(value, str):
        prompt = value
    elif isinstance(value, list | tuple) and value and isinstance(value[0], str):
        prompt = value[0]
    else:
        prompt = ""
    think_mode = _chat_think_mode(body, ctx_size, allow_think_key=True)
    text = completion_prompt_text(prompt, think_mode)
    return RenderedPrompt(text=text, think_mode=think_mode, tool_schemas="", messages=())
