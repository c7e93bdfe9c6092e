"""What the engine reported for the engine requests of the HTTP request being served.

vLLM's serving code reads `RequestOutput.num_cached_tokens` into usage only for some routes
and flags, and drops `kv_transfer_params` (where the ds4disk connector says how many prompt
tokens it loaded from disk) from streams and `/v1/responses`. The usage middleware therefore
opens a `RequestRecorder` in each HTTP request's context (`recording`, the request's
`recorder` in `ds4_vllm.serving.request_context`), and `record_outputs` wraps the engine
client's `generate` (`ds4_vllm.vllm_compat` installs it) to note each engine request's latest
output there. The same hook hands each finished sequence's exact ids to the text-keyed reuse of
the engine client's serving state (`SequenceCollector`, `ServingState.remember_sequence`).
No request ids are matched: the context ties outputs to their HTTP request.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

from ds4_vllm.contracts import DISK_TOKENS_PARAM
from ds4_vllm.serving.request_context import current_request, serving_request
from ds4_vllm.serving.state import serving_state_of_engine
from ds4_vllm.serving.usage import EngineCounts


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


@contextlib.contextmanager
def recording() -> Iterator[RequestRecorder]:
    """Open a recorder for the HTTP request served inside this block (and tasks started in it)."""
    recorder = RequestRecorder()
    with serving_request(recorder=recorder):
        yield recorder


class SequenceCollector:
    """The full ids of one engine request's completions, from its stream of `RequestOutput`s,
    handed to `remember` (prompt + output ids) for each completion that finished.

    With `output_kind` DELTA (streaming) each output carries only the new tokens; otherwise
    each carries all of them so far.
    """

    def __init__(self, sampling_params: Any, remember: Callable[[list[int]], None]) -> None:
        kind = getattr(sampling_params, "output_kind", None)
        self.delta = getattr(kind, "name", None) == "DELTA"
        self.remember = remember
        self.completions: dict[int, list[int]] = {}
        self.finished: dict[int, bool] = {}

    def note(self, output: Any) -> None:
        for completion in getattr(output, "outputs", None) or ():
            ids = list(getattr(completion, "token_ids", None) or ())
            index = getattr(completion, "index", 0)
            if self.delta:
                self.completions.setdefault(index, []).extend(ids)
            else:
                self.completions[index] = ids
            self.finished[index] = getattr(completion, "finish_reason", None) is not None
        if getattr(output, "finished", False):
            prompt_ids = list(getattr(output, "prompt_token_ids", None) or ())
            if not prompt_ids:
                return
            for index, ids in self.completions.items():
                if self.finished.get(index, True):
                    self.remember(prompt_ids + ids)


def _sampling_params(args: tuple, kwargs: dict) -> Any:
    """`generate`'s sampling params, wherever the caller passed them."""
    if "sampling_params" in kwargs:
        return kwargs["sampling_params"]
    return next((a for a in args if hasattr(a, "output_kind")), None)


def record_outputs(
    generate: Callable[..., AsyncGenerator[Any, None]],
) -> Callable[..., AsyncGenerator[Any, None]]:
    """Wrap an engine client's `generate` so each output is noted in the current recorder, and
    each finished sequence in the engine client's serving state.

    Outputs pass through unchanged. Closing the wrapper closes vLLM's generator at once, so a
    client that goes away still aborts its engine request.
    """

    @functools.wraps(generate)
    async def wrapper(engine: Any, *args: Any, **kwargs: Any) -> AsyncGenerator[Any, None]:
        recorder = current_request().recorder
        number = recorder.start() if recorder is not None else 0
        serving = serving_state_of_engine(engine)
        sequence = (
            SequenceCollector(_sampling_params(args, kwargs), serving.remember_sequence) if serving else None
        )
        async with contextlib.aclosing(generate(engine, *args, **kwargs)) as outputs:
            async for output in outputs:
                if recorder is not None:
                    recorder.note(number, output)
                if sequence is not None:
                    sequence.note(output)
                yield output

    return wrapper
