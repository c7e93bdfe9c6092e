"""`--reasoning-parser ds4`: `<think>...</think>` -> `reasoning_content` (and Anthropic thinking
blocks, Responses reasoning items, which vLLM builds from it).

The ds4 engine's rule (`split_reasoning_content`): a leading `<think>` is dropped and the text
splits at the first `</think>`. Whether thinking is on is not guessed from request fields: the
rendered prompt says it (it ends with `<think>` when on, `</think>` when off;
`ds4_vllm.chat.thinking.resolve_think_mode` decides), so an answer starts in reasoning exactly
when the prompt's last think tag is `<think>`.

An answer cut (by `max_tokens`) before its `</think>` is reasoning, streamed or not, and all its
tokens count as `reasoning_tokens`. The engine's non-streaming reply calls such text content
while its stream sends it as reasoning; one classification is what clients can rely on (issue 20).
vLLM gives the parser the prompt only when streaming; the renderer notes it for the others
(`ds4_vllm.serving.request_context.PromptFacts`). Outside an HTTP request (no note) the engine's
non-streaming rule applies: no `</think>`, all content.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import DeltaMessage
from vllm.reasoning.abs_reasoning_parsers import ReasoningParser

from ds4_vllm.chat.dsml import split_reasoning
from ds4_vllm.chat.tokenizer import THINK_END, THINK_START
from ds4_vllm.serving.request_context import current_request
from ds4_vllm.serving.tool_parser import keep_special_tokens


def _prompt_left_thinking_open() -> bool:
    facts = current_request().prompt
    return bool(facts is not None and facts.think_open)


class Ds4ReasoningParser(ReasoningParser):
    def __init__(self, tokenizer: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, *args, **kwargs)
        vocab = self.vocab
        self.think_start_id = vocab.get(THINK_START)
        self.think_end_id = vocab.get(THINK_END)
        if self.think_start_id is None or self.think_end_id is None:
            raise ValueError(f"the tokenizer has no {THINK_START!r} / {THINK_END!r} tokens")
        self._sent = 0  # reasoning characters sent while streaming
        self._ended = False

    @property
    def reasoning_start_str(self) -> str:
        return THINK_START

    @property
    def reasoning_end_str(self) -> str:
        return THINK_END

    def adjust_request(self, request: Any) -> Any:
        keep_special_tokens(request)
        return request

    def _last_think_tag(self, ids: Sequence[int]) -> int | None:
        for token in reversed(ids):
            if token == self.think_end_id or token == self.think_start_id:
                return token
        return None

    def is_reasoning_end(self, input_ids: Sequence[int]) -> bool:
        """Reasoning is over unless the last think tag is `<think>` (no tag at all: never began)."""
        return self._last_think_tag(input_ids) != self.think_start_id

    def is_reasoning_end_streaming(self, input_ids: Sequence[int], delta_ids: Iterable[int]) -> bool:
        return self._ended or self.think_end_id in delta_ids

    def extract_content_ids(self, input_ids: list[int]) -> list[int]:
        if self.think_end_id not in input_ids:
            return []
        return input_ids[len(input_ids) - input_ids[::-1].index(self.think_end_id) :]

    def count_reasoning_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens before the first `</think>`; without one, all of them when the prompt left
        thinking open (an answer cut while reasoning), else none."""
        ids = list(token_ids)
        if self.think_end_id in ids:
            return ids.index(self.think_end_id)
        return len(ids) if _prompt_left_thinking_open() else 0

    def extract_reasoning(self, model_output: str, request: Any) -> tuple[str | None, str | None]:
        if THINK_END not in model_output and _prompt_left_thinking_open():
            body = model_output.removeprefix(THINK_START)
            return body or None, None
        reasoning, content = split_reasoning(model_output)
        return reasoning, content or None

    def extract_reasoning_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
    ) -> DeltaMessage | None:
        """Called while the answer is in reasoning: reasoning until `</think>`, what follows it is
        content (the tool parser's text from then on). A tag split over deltas is held back."""
        if self._ended:
            return DeltaMessage(content=delta_text) if delta_text else None
        body = current_text
        if body.startswith(THINK_START):
            body = body[len(THINK_START) :]
        elif THINK_START.startswith(body):
            return None  # maybe a repeated <think>, not complete yet
        end = body.find(THINK_END)
        if end >= 0:
            self._ended = True
            reasoning = body[self._sent : end]
            content = body[end + len(THINK_END) :]
            return DeltaMessage(reasoning=reasoning or None, content=content or None)
        held = next(
            (k for k in range(min(len(THINK_END) - 1, len(body)), 0, -1) if body.endswith(THINK_END[:k])), 0
        )
        cut = len(body) - held
        if cut <= self._sent:
            return None
        delta = DeltaMessage(reasoning=body[self._sent : cut])
        self._sent = cut
        return delta
