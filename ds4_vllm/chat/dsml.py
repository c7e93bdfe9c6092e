"""DSML, the ds4 engine's tool-call block: written into prompts, read back from generated text.

Writing (the renderer, spec §8.1 `append_dsml_tool_calls_text`): `dsml_tool_calls` is the canonical
form of an assistant's calls; `replayed_dsml` gives the exact block the model sampled instead, when
every call id maps to it (exact replay). Reading (`parse_generated`, `parse_generated_message_ex`):
generated text -> reasoning, content and tool calls, the way the engine reads its own output.

The model writes tool calls as a DSML block::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="city" string="true">Paris &amp; co</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

The block's exact bytes (leading blank line included) are what exact replay remembers: the client
gets JSON arguments, and re-rendering JSON rarely gives back the sampled bytes. Both the API server
(tool parser) and the engine core (KTM trailers) call `parse_generated`, so they agree on which
block was sampled and how many calls it holds.

Reading rules, as the engine's:
- Reasoning: a leading `<think>` is dropped and the text splits at the first `</think>`; without
  one, everything is content.
- The block is looked for after the last `</think>`. Three spellings are accepted: `｜DSML｜`, the
  same with the first bar missing (`DSML｜`), and plain `<tool_calls>`/`<invoke>`/`<parameter>`.
- Content is the text before the block, trailing whitespace removed; text after the block is dropped.
- String values undo the renderer's entities (`&amp; &lt; &gt; &quot; &apos;`); other values are JSON.
  A parameter without `string=` is a string, unless other parameters are nested inside it (an object).
- A block that does not parse leaves the whole text as content, with no calls.

Two deliberate differences: the block is the earliest-starting of the three spellings (the engine
prefers spellings in order, then position; only pathological outputs differ), and a non-string value
that is not valid JSON becomes a JSON string instead of making the arguments invalid JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Sequence

from .fields import cstr
from .json_text import C_SPACE, JsonTextError, json_string, minify, read_string, skip_space, skip_value
from .messages import Replay, ToolCall
from .tokenizer import THINK_END, THINK_START

#: The closing parameter tag, escaped inside values the canonical writer puts in a block.
DSML_PARAMETER_CLOSE = "</｜DSML｜parameter>"

#: The three block spellings: (tool_calls open, close, invoke open, close, parameter open, close).
_FORMS: tuple[tuple[str, str, str, str, str, str], ...] = tuple(
    (
        f"<{m}tool_calls>",
        f"</{m}tool_calls>",
        f"<{m}invoke",
        f"</{m}invoke>",
        f"<{m}parameter",
        f"</{m}parameter>",
    )
    for m in ("｜DSML｜", "DSML｜", "")
)
#: Every string that can start a block, for holding back streamed text that might become one.
BLOCK_STARTS: tuple[str, ...] = tuple(form[0] for form in _FORMS)
_ENTITIES = re.compile("&(amp|lt|gt|quot|apos);")
_ENTITY_CHARS = {"amp": "&", "lt": "<", "gt": ">", "quot": '"', "apos": "'"}


class DsmlError(ValueError):
    """A tool-call block that does not parse; the message names the offset in the parsed text."""


@dataclasses.dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One invoke: the function name and its arguments as compact JSON object text."""

    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallsParse:
    """What the content part of an answer holds. `raw_dsml` is the exact block, `span` its offsets."""

    content: str
    calls: tuple[ParsedToolCall, ...] = ()
    raw_dsml: str | None = None
    span: tuple[int, int] | None = None
    error: str | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class GeneratedMessage:
    """A whole generated answer: reasoning (None without `</think>`), content and tool calls."""

    reasoning: str | None
    content: str
    calls: tuple[ParsedToolCall, ...] = ()
    raw_dsml: str | None = None
    error: str | None = None


def dsml_unescape(text: str) -> str:
    """Undo the five entities the engine's parser knows; any other `&` stays as it is."""
    return _ENTITIES.sub(lambda m: _ENTITY_CHARS[m.group(1)], text)


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, content): a leading `<think>` dropped, split at the first `</think>`."""
    body = text[len(THINK_START) :] if text.startswith(THINK_START) else text
    end = body.find(THINK_END)
    if end < 0:
        return None, text
    return body[:end], body[end + len(THINK_END) :]


def find_block_start(text: str, start: int = 0) -> tuple[int, int] | None:
    """(offset, form index) of the earliest block opening at or after `start`, a directly
    preceding blank line ("\\n\\n") included."""
    best: tuple[int, int] | None = None
    for index, opening in enumerate(BLOCK_STARTS):
        at = text.find(opening, start)
        if at >= 0 and (best is None or at < best[0]):
            best = (at, index)
    if best is None:
        return None
    at, index = best
    if at - 2 >= start and text.startswith("\n\n", at - 2):
        at -= 2
    return at, index


def tool_search_start(content: str) -> int:
    """Blocks are looked for after the last `</think>` (DSML inside reasoning is not a call)."""
    end = content.rfind(THINK_END)
    return 0 if end < 0 else end + len(THINK_END)


def parse_tool_calls(content: str) -> ToolCallsParse:
    """The tool-call block of an answer's content part (the text after reasoning), if any."""
    found = find_block_start(content, tool_search_start(content))
    if found is None:
        return ToolCallsParse(content)
    start, form = found
    try:
        calls, end = _parse_block(content, start, _FORMS[form])
    except DsmlError as exc:
        return ToolCallsParse(content, error=str(exc))
    return ToolCallsParse(content[:start].rstrip(C_SPACE), tuple(calls), content[start:end], (start, end))


def parse_generated(text: str) -> GeneratedMessage:
    """A whole answer (the text generated after the prompt) as the engine parses it."""
    reasoning, content = split_reasoning(text)
    parsed = parse_tool_calls(content)
    if parsed.error is not None:
        return GeneratedMessage(None, text, error=parsed.error)
    return GeneratedMessage(reasoning, parsed.content, parsed.calls, parsed.raw_dsml)


# -- the block grammar --------------------------------------------------------------------------


def _attr(tag: str, name: str) -> str | None:
    """`name="value"` inside a tag (the first occurrence), entities undone."""
    key = f'{name}="'
    at = tag.find(key)
    if at < 0:
        return None
    at += len(key)
    end = tag.find('"', at)
    return None if end < 0 else dsml_unescape(tag[at:end])


def _tag(text: str, pos: int, what: str) -> tuple[str, int]:
    end = text.find(">", pos)
    if end < 0:
        raise DsmlError(f"offset {pos}: {what} tag is not closed with '>'")
    return text[pos : end + 1], end + 1


def _json_value(raw: str) -> str:
    """A non-string value as compact JSON; text that is not JSON becomes a JSON string."""
    stripped = raw.strip(C_SPACE)
    if not stripped:
        return "null"
    try:
        json.loads(stripped)
    except ValueError:
        return json_string(raw)
    return minify(stripped)


def _member(name: str, value: str, is_string: bool) -> str:
    return json_string(name) + ":" + (json_string(value) if is_string else _json_value(value))


def _leaf(text: str, pos: int, param_open: str, param_close: str) -> tuple[str, int]:
    """One `<parameter ...>value</parameter>` as a JSON member, and the offset after it."""
    tag, value_start = _tag(text, pos, "parameter")
    name = _attr(tag, "name")
    if name is None:
        raise DsmlError(f"offset {pos}: parameter without a name")
    kind = _attr(tag, "string") or "true"
    value_end = text.find(param_close, value_start)
    if value_end < 0:
        raise DsmlError(f"offset {pos}: parameter {name!r} is not closed")
    raw = text[value_start:value_end]
    if kind == "true":
        return _member(name, dsml_unescape(raw), True), value_end + len(param_close)
    return _member(name, raw, False), value_end + len(param_close)


def _parse_block(
    text: str, start: int, form: tuple[str, str, str, str, str, str]
) -> tuple[list[ParsedToolCall], int]:
    """The calls of the block at `start` and the offset just past its closing tag."""
    calls_open, calls_close, invoke_open, invoke_close, param_open, param_close = form
    pos = text.index(calls_open, start) + len(calls_open)
    calls: list[ParsedToolCall] = []
    while True:
        pos = skip_space(text, pos)
        if text.startswith(calls_close, pos):
            return calls, pos + len(calls_close)
        if not text.startswith(invoke_open, pos):
            what = "the end of the text" if pos >= len(text) else repr(text[pos : pos + 20])
            raise DsmlError(f"offset {pos}: expected an invoke or the block's end, found {what}")
        invoke_at = pos
        tag, pos = _tag(text, pos, "invoke")
        name = _attr(tag, "name")
        if name is None:
            raise DsmlError(f"offset {invoke_at}: invoke without a name")
        members: list[str] = []
        while True:
            pos = skip_space(text, pos)
            if text.startswith(invoke_close, pos):
                pos += len(invoke_close)
                break
            if not text.startswith(param_open, pos):
                what = "the end of the text" if pos >= len(text) else repr(text[pos : pos + 20])
                raise DsmlError(f"offset {pos}: expected a parameter of {name!r}, found {what}")
            tag, value_start = _tag(text, pos, "parameter")
            param = _attr(tag, "name")
            if param is None:
                raise DsmlError(f"offset {pos}: parameter of {name!r} without a name")
            if _attr(tag, "string") is None and text.startswith(param_open, skip_space(text, value_start)):
                nested, pos = _nested_object(text, value_start, param_open, param_close)
                members.append(json_string(param) + ":" + nested)
                pos = skip_space(text, pos)
                if text.startswith(param_close, pos):
                    pos += len(param_close)
                continue
            member, pos = _leaf(text, pos, param_open, param_close)
            members.append(member)
        calls.append(ParsedToolCall(name, "{" + ",".join(members) + "}"))


def _nested_object(text: str, pos: int, param_open: str, param_close: str) -> tuple[str, int]:
    """Parameters written inside a parameter without `string=`: one JSON object of them."""
    members: list[str] = []
    while True:
        pos = skip_space(text, pos)
        if not text.startswith(param_open, pos):
            break
        member, pos = _leaf(text, pos, param_open, param_close)
        members.append(member)
    return "{" + ",".join(members) + "}", pos


# -- writing: the canonical block and exact replay (the renderer) -----------------------------


def _attr_escape(s: str) -> str:
    """`attr`: `& < > \"` as entities (names in the canonical form)."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def _parse_arguments(arguments: str) -> list[tuple[str, str, bool]] | None:
    """(key, value, is_string) per member of a JSON object text (`json_args_parse`); None when the
    text is not an object. String values are unescaped, others minified raw text."""
    text = cstr(arguments)
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
        out.append(f'<｜DSML｜invoke name="{_attr_escape(cstr(call.name))}">\n')
        args = _parse_arguments(call.arguments)
        if args is None:
            out.append('<｜DSML｜parameter name="arguments" string="true">')
            out.append(cstr(call.arguments).replace(DSML_PARAMETER_CLOSE, "&lt;" + DSML_PARAMETER_CLOSE[1:]))
            out.append(DSML_PARAMETER_CLOSE + "\n")
        else:
            for key, value, is_string in args:
                if is_string:
                    value = value.replace(DSML_PARAMETER_CLOSE, "&lt;" + DSML_PARAMETER_CLOSE[1:])
                else:
                    value = value.replace(DSML_PARAMETER_CLOSE, "\\u003c" + DSML_PARAMETER_CLOSE[1:])
                flag = "true" if is_string else "false"
                out.append(
                    f'<｜DSML｜parameter name="{_attr_escape(key)}" string="{flag}">{value}{DSML_PARAMETER_CLOSE}\n'
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
