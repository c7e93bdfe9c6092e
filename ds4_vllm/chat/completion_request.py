"""/v1/completions requests -> the engine's §8.2 prompt (`parse_completion_request`)."""

from __future__ import annotations

from collections.abc import Mapping

from .fields import RenderError, load_request
from .template import RenderedPrompt, completion_prompt_text
from .thinking import COMPLETION_THINKING, resolve_think_mode


def render_completion(request: Mapping | bytes | str, *, ctx_size: int) -> RenderedPrompt:
    """/v1/completions: `prompt` is a string, or an array whose first element is used when it is
    a string; any other value is the empty prompt."""
    body = load_request(request, "completion")
    if "prompt" not in body:
        raise RenderError("missing prompt")
    value = body["prompt"]
    if isinstance(value, str):
        prompt = value
    elif isinstance(value, list | tuple) and value and isinstance(value[0], str):
        prompt = value[0]
    else:
        prompt = ""
    think_mode = resolve_think_mode(body, COMPLETION_THINKING, ctx_size=ctx_size)
    text = completion_prompt_text(prompt, think_mode)
    return RenderedPrompt(text=text, think_mode=think_mode, tool_schemas="", messages=())
