"""Whether a request thinks, and how hard: one resolver for every API (`resolve_think_mode`).

The ds4 engine's think mode is none, high or max (max adds THINK_MAX_PREFIX to the prompt). Each
API's parser reads its own fields (`ThinkingFields`, one table per API below); the precedence is
the same for all, lowest first:

1. Default: thinking on, effort high.
2. vLLM's spelling in the request, `chat_template_kwargs` {"enable_thinking" | "thinking": bool,
   "reasoning_effort": name} ("thinking" read after "enable_thinking"; effort "none" turns
   thinking off).
3. The server's thinking switch as vLLM resolved it (`vllm_switch`: its `chat_template_kwargs`
   with the server's defaults merged in; the serving layer passes it where vLLM's value is not
   derived from the engine's own fields).
4. The engine's fields of the API, in the order the client wrote them, a later one overriding an
   earlier one (the engine reads the JSON object in order): a switch sets thinking on or off, an
   effort sets the effort. On /v1/responses the effort (`reasoning.effort`) is the switch too:
   "none" is off, any other effort on.
5. The model aliases, only if nothing in 2-4 switched thinking: `deepseek-chat` off,
   `deepseek-reasoner` on.
6. Off, or effort "none", is no thinking; effort max is max only with a context of at least
   THINK_MAX_MIN_CONTEXT tokens (`ds4_think_mode_for_context`), else high.

Steps 1 and 4-6 are the engine's own (kvc-format.md §8.1); 2 and 3 are vLLM's switches, which
the engine's fields override.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from .fields import RenderError, cstr, str_field


class ThinkMode(enum.Enum):
    NONE = "none"
    HIGH = "high"
    MAX = "max"

    @property
    def enabled(self) -> bool:
        return self is not ThinkMode.NONE


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

_EFFORTS = {
    "max": ThinkMode.MAX,
    "xhigh": ThinkMode.HIGH,
    "high": ThinkMode.HIGH,
    "medium": ThinkMode.HIGH,
    "low": ThinkMode.HIGH,
    "minimal": ThinkMode.HIGH,
    "none": ThinkMode.NONE,
}
_MODEL_ALIASES = {"deepseek-chat": False, "deepseek-reasoner": True}
#: The model names the ds4 engine answers to (`ds4_server.c`: its /v1/models id and the aliases).
ENGINE_MODEL_NAMES = ("deepseek-v4-flash", *_MODEL_ALIASES)


def is_thinking_alias(model: object) -> bool:
    """Whether a request's `model` is one of the names that select thinking (`deepseek-chat`...)."""
    return isinstance(model, str) and cstr(model) in _MODEL_ALIASES


@dataclasses.dataclass(frozen=True, slots=True)
class ThinkingFields:
    """The body fields one API's parser reads for thinking (the engine's parser of that API)."""

    #: Top-level switches: `thinking` (true/false or {"type": "enabled" | "disabled"}), `think` (a bool).
    switches: tuple[str, ...] = ()
    #: Where an effort name is: a top-level key, or (object key, member key).
    efforts: tuple[tuple[str, ...], ...] = ()
    #: The effort is also the switch: "none" off, other efforts on (/v1/responses).
    effort_switches: bool = False


#: /v1/chat/completions (`parse_chat_request`) and /v1/completions (`parse_completion_request`).
CHAT_THINKING = ThinkingFields(switches=("thinking", "think"), efforts=(("reasoning_effort",),))
COMPLETION_THINKING = CHAT_THINKING
#: /v1/messages (`parse_anthropic_request`).
ANTHROPIC_THINKING = ThinkingFields(
    switches=("thinking",), efforts=(("output_config", "effort"), ("reasoning_effort",))
)
#: /v1/responses (`parse_responses_request`): only `reasoning.effort`.
RESPONSES_THINKING = ThinkingFields(efforts=(("reasoning", "effort"),), effort_switches=True)


def parse_effort(value: Any, field: str) -> ThinkMode | None:
    """A reasoning effort name (None for JSON null); unknown names are refused."""
    if value is None:
        return None
    if not isinstance(value, str) or cstr(value) not in _EFFORTS:
        raise RenderError(f"{field}: unknown reasoning effort {value!r}")
    return _EFFORTS[cstr(value)]


def think_mode_for(*, enabled: bool = True, effort: ThinkMode = ThinkMode.HIGH, ctx_size: int) -> ThinkMode:
    """Step 6: off when disabled or effort none; max only with a big enough context."""
    if not enabled or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    if effort is ThinkMode.MAX:
        return ThinkMode.MAX if max(ctx_size, 0) >= THINK_MAX_MIN_CONTEXT else ThinkMode.HIGH
    return ThinkMode.HIGH


@dataclasses.dataclass(slots=True)
class _Thinking:
    enabled: bool = True
    effort: ThinkMode = ThinkMode.HIGH
    switched: bool = False

    def switch(self, enabled: bool) -> None:
        self.enabled, self.switched = enabled, True

    def set_effort(self, value: Any, field: str, *, switches: bool = False) -> None:
        effort = parse_effort(value, field)
        if effort is None:  # null: as if absent
            return
        self.effort = effort
        if switches:
            self.switch(effort is not ThinkMode.NONE)


def resolve_think_mode(
    body: Mapping, fields: ThinkingFields, *, ctx_size: int, vllm_switch: bool | None = None
) -> ThinkMode:
    """The think mode of a request body under the precedence of the module docstring."""
    state = _Thinking()
    kwargs = body.get("chat_template_kwargs")
    if isinstance(kwargs, Mapping):  # step 2
        for key in ("enable_thinking", "thinking"):
            if isinstance(kwargs.get(key), bool):
                state.switch(kwargs[key])
        if kwargs.get("reasoning_effort") is not None:
            state.set_effort(kwargs["reasoning_effort"], "chat_template_kwargs.reasoning_effort")
            if state.effort is ThinkMode.NONE:
                state.switch(False)
    if vllm_switch is not None:  # step 3
        state.switch(vllm_switch)
    for key, value in body.items():  # step 4, in the client's order
        if key in fields.switches:
            state.switch(_switch_value(key, value, state.enabled))
        for path in fields.efforts:
            if path[0] != key:
                continue
            if len(path) == 1:
                state.set_effort(value, key, switches=fields.effort_switches)
            elif isinstance(value, Mapping) and path[1] in value:
                state.set_effort(value[path[1]], ".".join(path), switches=fields.effort_switches)
    model = body.get("model")
    if not state.switched and isinstance(model, str):  # step 5
        state.enabled = _MODEL_ALIASES.get(cstr(model), state.enabled)
    return think_mode_for(enabled=state.enabled, effort=state.effort, ctx_size=ctx_size)


def _switch_value(key: str, value: Any, enabled: bool) -> bool:
    """A switch field's value: `think` must be a bool; `thinking` is a bool or {"type": ...}, and
    anything else leaves thinking as it is (while still counting as a switch, as in the engine)."""
    if key == "think":
        if not isinstance(value, bool):
            raise RenderError("think: expected true or false")
        return value
    if isinstance(value, bool):
        return value
    if isinstance(value, Mapping) and "type" in value:
        kind = str_field(value, "type", key)
        if kind == "enabled":
            return True
        if kind == "disabled":
            return False
    return enabled
