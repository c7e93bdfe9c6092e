"""The HTTP request being served, for the code vLLM runs inside it without handing it the request.

vLLM gives a renderer parsed messages and its engine client only prompts, and ds4 needs two more
things from the HTTP request there. They travel beside vLLM's arguments in one context variable,
read with `current_request()`:

- `raw`: the body exactly as the client sent it, on the routes the ds4 engine's parsers render
  (`RawRequestBodyMiddleware`, `ds4_vllm.serving.request_body`); read by the renderer;
- `recorder`: what the engine reported for the request's engine requests (opened by
  `Ds4UsageMiddleware`, filled by the `AsyncLLM.generate` hook, `ds4_vllm.serving.request_outputs`);
  read by the usage rewrite;
- `prompt`: what the renderer learned of the prompt it rendered (`PromptFacts`: whether it ends
  inside `<think>`), read by the reasoning parser, which vLLM does not give the prompt on
  non-streaming routes.

FastAPI runs the route handler in the middleware's task, and everything vLLM awaits from it
(asyncio tasks, a streaming body) gets a copy of that context, so each request sees its own, with
no shared table and no request-id matching. Threads do not inherit it: the renderer reads it in
its async method, before it hands work to a thread. Outside an HTTP request (offline `LLM`,
vLLM's own extra renderings done elsewhere) both are None.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ds4_vllm.contracts import THINK_END, THINK_START

if TYPE_CHECKING:
    from ds4_vllm.serving.request_body import RawRequest
    from ds4_vllm.serving.request_outputs import RequestRecorder


@dataclasses.dataclass(slots=True)
class PromptFacts:
    """Filled by the renderer once it rendered the request's prompt."""

    #: The prompt's last think tag is `<think>`: the answer starts in reasoning.
    think_open: bool | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RequestContext:
    """What ds4 knows of the HTTP request being served (see the module docstring)."""

    raw: RawRequest | None = None
    recorder: RequestRecorder | None = None
    prompt: PromptFacts | None = None


_OUTSIDE = RequestContext()
_CURRENT: contextvars.ContextVar[RequestContext | None] = contextvars.ContextVar("ds4_request", default=None)


def note_prompt(text: str) -> None:
    """Record what the reasoning parser needs of the prompt just rendered for this request."""
    facts = current_request().prompt
    if facts is not None:
        facts.think_open = text.rfind(THINK_START) > text.rfind(THINK_END)


def current_request() -> RequestContext:
    """The context of the HTTP request being served here (empty outside one)."""
    return _CURRENT.get() or _OUTSIDE


@contextlib.contextmanager
def serving_request(**fields: Any) -> Iterator[RequestContext]:
    """Inside the block, the request's context with `fields` set (an outer middleware's kept)."""
    context = dataclasses.replace(current_request(), **fields)
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
