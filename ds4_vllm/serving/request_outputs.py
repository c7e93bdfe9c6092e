"""What the engine reported for the engine requests of the HTTP request being served.

vLLM's serving code reads `RequestOutput.num_cached_tokens` into usage only for some routes
and flags, and drops `kv_transfer_params` (where the ds4disk connector says how many prompt
tokens it loaded from disk) from streams and `/v1/responses`. The ASGI middleware therefore
opens a `RequestRecorder` for each HTTP request (a context variable, inherited by the tasks
that serve it), and `record_outputs` wraps the engine client's `generate`
(`ds4_vllm.vllm_compat` installs it) to note each engine request's latest output there.
The same wrapper hands each finished sequence's ids to the text-keyed reuse (`token_memory`).
No request ids are matched: the context variable ties outputs to their HTTP request.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import AsyncGenerator, Callable
from typing import Any

from ds4_vllm.serving.token_memory import SequenceCollector
from ds4_vllm.serving.usage import EngineCounts

#: The `kv_transfer_params` key under which the ds4disk connector reports the prompt tokens it
#: loaded from disk for a request (on the request's final output).
DISK_TOKENS_PARAM = "ds4_disk_tokens"

_current: contextvars.ContextVar[RequestRecorder | None] = contextvars.ContextVar(
    "ds4_request_recorder", default=None
)


class RequestRecorder:
    """The latest output of each engine request started while serving one HTTP request."""

    def __init__(self) -> None:
        self._outputs: dict[int, Any] = {}  # generator number -> latest RequestOutput
        self._started = 0

    def start(self) -> int:
        self._started += 1
        return self._started

    def note(self, generator: int, output: Any) -> None:
        self._outputs[generator] = output

    @property
    def started(self) -> int:
        return self._started

    def counts(self) -> EngineCounts | None:
        """Sums over the engine requests that produced output; None when none did."""
        if not self._outputs:
            return None
        prompt = cached = disk = 0
        finished = True
        for output in self._outputs.values():
            prompt += len(getattr(output, "prompt_token_ids", None) or ())
            cached += getattr(output, "num_cached_tokens", None) or 0
            disk += disk_tokens_of(getattr(output, "kv_transfer_params", None))
            finished = finished and bool(getattr(output, "finished", False))
        return EngineCounts(
            prompt_tokens=prompt, cached_tokens=cached, disk_tokens=disk if finished else None
        )


def disk_tokens_of(kv_transfer_params: Any) -> int:
    """The ds4disk connector's disk-loaded token count in a final output's `kv_transfer_params`."""
    if not isinstance(kv_transfer_params, dict):
        return 0
    value = kv_transfer_params.get(DISK_TOKENS_PARAM, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _sampling_params(args: tuple, kwargs: dict) -> Any:
    """`generate`'s sampling params, wherever the caller passed them (bound or unbound wrapper)."""
    if "sampling_params" in kwargs:
        return kwargs["sampling_params"]
    return next((a for a in args if hasattr(a, "output_kind")), None)


@contextlib.contextmanager
def recording() -> Any:
    """Open a recorder for the HTTP request served inside this block (and tasks started in it)."""
    recorder = RequestRecorder()
    token = _current.set(recorder)
    try:
        yield recorder
    finally:
        _current.reset(token)


def current_recorder() -> RequestRecorder | None:
    return _current.get()


def record_outputs(
    generate: Callable[..., AsyncGenerator[Any, None]],
) -> Callable[..., AsyncGenerator[Any, None]]:
    """Wrap an engine client's `generate` so each output is noted in the current recorder.

    Outputs pass through unchanged. Closing the wrapper closes vLLM's generator at once, so a
    client that goes away still aborts its engine request.
    """

    @functools.wraps(generate)
    async def wrapper(*args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        recorder = _current.get()
        number = recorder.start() if recorder is not None else 0
        # Every finished sequence's exact ids, for text-keyed reuse of the next turn.
        sequence = SequenceCollector(_sampling_params(args, kwargs))
        async with contextlib.aclosing(generate(*args, **kwargs)) as outputs:
            async for output in outputs:
                if recorder is not None:
                    recorder.note(number, output)
                sequence.note(output)
                yield output

    return wrapper
