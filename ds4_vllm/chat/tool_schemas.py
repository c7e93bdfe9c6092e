"""The tools block of the system prompt: one schema JSON text per tool, as the client sent it.

The engine copies schemas into the prompt byte for byte (`parse_tools_value`,
`append_raw_json_line`), so the cache key depends on the client's exact JSON formatting:
- an OpenAI `{"type": "function", "function": {...}}` tool: the raw `function` value;
- Responses `type: "namespace"` tools: each function member re-serialized with `namespace + name`;
- the Responses hosted `tool_search` tool: re-serialized as a function schema;
- any other object (Anthropic tools, flat Responses function tools): the raw object.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .fields import RenderError, array_value, cstr, json_escape
from .json_text import JsonTextError, parse_json, raw_text

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
_DEFAULT_PARAMETERS = '{"type":"object","properties":{}}'
_MISSING = object()


def tool_schema_lines(tools: Any, *, path: str = "tools") -> list[str]:
    """One schema JSON text per tool (`parse_tools_value`), from a parsed `tools` array."""
    if tools is None:
        return []
    lines: list[str] = []
    for tool in array_value(tools, path):
        if isinstance(tool, Mapping) and "function" in tool:
            lines.append(raw_text(tool["function"]))  # OpenAI wrapper: the raw `function` value
            continue
        members = _namespace_member_schemas(tool)
        if members:
            lines.extend(members)
            continue
        special = _tool_search_schema(tool)
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


def request_tool_schemas(body: Mapping, tools_json: bytes | str | None) -> str:
    """A request's SCHEMAS: from the raw bytes of its `tools` when given, else from the body."""
    if tools_json is not None:
        return tool_schemas_text(tools_json)
    return "\n".join(tool_schema_lines(body["tools"])) if "tools" in body else ""


def tools_block(schemas: str) -> str:
    """The tools section at the start of SYSTEM (`append_tools_prompt_text`); "" without schemas."""
    return TOOLS_PREAMBLE + schemas + TOOLS_POSTAMBLE if schemas else ""


def _namespace_member_schemas(tool: Any) -> list[str]:
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
        if not isinstance(m_name, str) or not cstr(m_name):
            continue
        description = member.get("description", "")
        if not isinstance(description, str):
            continue
        params = _last_present(member, ("parameters", "input_schema"))
        out.append(
            '{"name":'
            + json_escape(cstr(name) + cstr(m_name))
            + ',"description":'
            + json_escape(description)
            + ',"parameters":'
            + (raw_text(params) if params is not _MISSING else _DEFAULT_PARAMETERS)
            + "}"
        )
    return out


def _tool_search_schema(tool: Any) -> str | None:
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


def _last_present(obj: Mapping, keys: Sequence[str]) -> Any:
    """Value of whichever of `keys` came last in the object (the engine keeps the last one read)."""
    found = _MISSING
    for key in obj:
        if key in keys:
            found = obj[key]
    return found
