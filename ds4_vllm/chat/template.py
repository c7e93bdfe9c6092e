"""The prompt templates (kvc-format.md §8.1 chat, §8.2 completion): messages -> the engine's prompt text.

The rendered text is the disk-cache key: one byte of difference and an engine checkpoint is never
found, so every rule is the engine's, quirks included (when old reasoning is kept, which roles
render, where separators go).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from .dsml import dsml_tool_calls, replayed_dsml
from .fields import cstr
from .messages import ChatMessage, Replay
from .thinking import THINK_MAX_PREFIX, ThinkMode
from .tokenizer import ASSISTANT, BOS, EOS, THINK_END, THINK_START, USER
from .tool_schemas import tools_block

COMPLETION_SYSTEM = "You are a helpful assistant"
TOOL_RESULT_OPEN = "<tool_result>"
TOOL_RESULT_CLOSE = "</tool_result>"


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


def rendered_chat(
    messages: list[ChatMessage],
    schemas: str,
    *,
    tools_active: bool,
    think_mode: ThinkMode,
    replay: Replay | None,
) -> RenderedPrompt:
    """The §8.1 rendering of a converted request; the tools block only when `tools_active`."""
    active = schemas if tools_active else ""
    text = render_messages(messages, think_mode=think_mode, tool_schemas=active, replay=replay)
    return RenderedPrompt(text=text, think_mode=think_mode, tool_schemas=active, messages=tuple(messages))


def completion_prompt_text(prompt: str, think_mode: ThinkMode) -> str:
    """The fixed §8.2 wrapper around a /v1/completions prompt."""
    return (
        BOS
        + (THINK_MAX_PREFIX if think_mode is ThinkMode.MAX else "")
        + COMPLETION_SYSTEM
        + USER
        + cstr(prompt)
        + ASSISTANT
        + (THINK_START if think_mode.enabled else THINK_END)
    )
