"""A conversation after conversion from any API: the engine's `chat_msg` list."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

#: Returns the exact sampled DSML block for a tool-call id, or None when unknown (exact replay:
#: the engine's tool memory and KTM trailers).
Replay = Callable[[str], str | None]


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
