"""`--tool-call-parser ds4`: DSML tool calls -> OpenAI `tool_calls` (and so Anthropic `tool_use`
blocks and Responses `function_call` items, which vLLM builds from them, ids included).

Parsing is ds4's (`ds4_vllm.chat.dsml`): string values lose the renderer's entities (`&lt;`,
`&amp;`, ...), non-string values are JSON, a malformed block stays content. Each call's id is
derived from the request's secret seed (`tool_replay.call_ids_for`), so the ds4disk connector
writes the same id into the checkpoint that holds the block; the id and the exact block go into
the server's tool memory for exact replay (`ServingState`, reached through the renderer's
tokenizer, which vLLM builds this parser with).

Streaming sends content as it comes, holding back only what could be the start of a block (and
the whitespace before it, which the block absorbs), and sends the calls, ids, names and whole
arguments, once the block is closed: a call's id depends on the whole block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.entrypoints.generate.base.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ExtractedToolCallInformation,
    FunctionCall,
    ToolCall,
)
from vllm.tool_parsers.abstract_tool_parser import ToolParser
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

from ds4_vllm.chat.dsml import BLOCK_STARTS, find_block_start, parse_tool_calls, tool_search_start
from ds4_vllm.serving.state import serving_state_for_tokenizer
from ds4_vllm.serving.tool_replay import call_ids_for

_C_SPACE = " \t\n\v\f\r"
_BLOCK_ENDS = tuple("</" + start[1:] for start in BLOCK_STARTS)


def keep_special_tokens(request: Any) -> None:
    """DSML and think tags are special tokens: the parsers need them in the output text, and the
    remembered block must be the sampled bytes, with no spaces added between special tokens."""
    request.skip_special_tokens = False
    if hasattr(request, "spaces_between_special_tokens"):
        request.spaces_between_special_tokens = False


def _held_suffix(text: str) -> int:
    """Length of the longest end of `text` that could grow into a block opening."""
    longest = 0
    for opening in BLOCK_STARTS:
        for k in range(min(len(opening) - 1, len(text)), longest, -1):
            if text.endswith(opening[:k]):
                longest = k
                break
    return longest


#: Whitespace the DSML constraint allows between the parts of a call's arguments. Unbounded (the
#: default), a model may keep emitting whitespace inside a forced call until `max_tokens`; the
#: engine's own DSML has none beyond the separators the format writes.
MAX_ARGUMENT_WHITESPACE = 2


def _bound_whitespace(node: Any) -> None:
    """Set `max_whitespace_cnt` on every JSON-schema part of an xgrammar structural-tag format."""
    if getattr(node, "type", None) == "json_schema" and getattr(node, "max_whitespace_cnt", 0) is None:
        node.max_whitespace_cnt = MAX_ARGUMENT_WHITESPACE
    for child_name in ("elements", "tags", "content"):
        child = getattr(node, child_name, None)
        for item in child if isinstance(child, list) else [child] if child is not None else []:
            _bound_whitespace(item)


class Ds4ToolParser(ToolParser):
    # "required" and named tool_choice are parsed from DSML too: ds4 writes no JSON tool calls.
    supports_required_and_named = False
    # ... and enforced with xgrammar's DeepSeek V4 DSML structural tag (the engine's DSML), the
    # arguments against each tool's JSON schema; vLLM applies it after the reasoning ends. No
    # `default_tool_strict_level`: a server-wide level would also constrain "auto" requests that
    # carry structured outputs (vLLM then ORs the tool tag with the user's format).
    structural_tag_model = "deepseek_v4"
    # Only so that vLLM calls `finish_streaming` at the end of a stream (to flush held-back text);
    # with a non-engine reasoning parser vLLM keeps feeding whole accumulated texts.
    engine_based_streaming = True

    def __init__(self, tokenizer: Any, tools: list | None = None) -> None:
        super().__init__(tokenizer, tools)
        self.serving = serving_state_for_tokenizer(tokenizer)
        self._request: Any = None
        self._text = ""
        self._sent = 0  # content characters sent
        self._block_at: int | None = None
        self._done = False

    def adjust_request(self, request: Any) -> Any:
        keep_special_tokens(request)
        self.serving.attach_tool_transfer_params(request)
        return request

    def get_structural_tag(
        self, request: Any, *, reasoning: bool = False, strict_level: ToolStrictLevel = ToolStrictLevel.AUTO
    ) -> Any:
        """The DSML constraint for `tool_choice` "required" or a named function, arguments pinned to
        their schemas; under "auto" the answer stays unconstrained, as the ds4 engine samples it
        (unless the operator's `--tool-strict-level` or a `strict` tool asks otherwise)."""
        if request.tool_choice == "auto" or request.tool_choice is None:
            return None
        strict_level = max(strict_level, ToolStrictLevel.PARAMETER)
        tag = super().get_structural_tag(request, reasoning=reasoning, strict_level=strict_level)
        if tag is not None:
            _bound_whitespace(tag.format)
        return tag

    # ------------------------------------------------------------------ whole answers

    def extract_tool_calls(self, model_output: str, request: Any) -> ExtractedToolCallInformation:
        parsed = parse_tool_calls(model_output)
        if not parsed.calls or parsed.raw_dsml is None:
            return ExtractedToolCallInformation(
                tools_called=False, tool_calls=[], content=parsed.content or None
            )
        ids = call_ids_for(request, parsed.raw_dsml, len(parsed.calls))
        self.serving.tool_memory.remember_calls(ids, parsed.raw_dsml)
        calls = [
            ToolCall(id=i, function=FunctionCall(id=i, name=c.name, arguments=c.arguments))
            for i, c in zip(ids, parsed.calls, strict=True)
        ]
        return ExtractedToolCallInformation(
            tools_called=True, tool_calls=calls, content=parsed.content or None
        )

    # ------------------------------------------------------------------ streaming

    def extract_tool_calls_streaming(
        self,
        previous_text: str,
        current_text: str,
        delta_text: str,
        previous_token_ids: Sequence[int],
        current_token_ids: Sequence[int],
        delta_token_ids: Sequence[int],
        request: Any,
    ) -> DeltaMessage | None:
        self._request = request
        # Our own accumulation: vLLM passes whole texts, or only deltas when no reasoning parser
        # is configured (this class counts as engine-based then); the deltas are right in both.
        self._text += delta_text
        if self._done:
            return None  # text after the block is dropped, as in a whole answer
        text = self._text
        if self._block_at is None:
            found = find_block_start(text, tool_search_start(text))
            if found is None:
                cut = len(text) - _held_suffix(text)
                cut = len(text[:cut].rstrip(_C_SPACE))
                return self._content_upto(cut)
            self._block_at = found[0]
            content = self._content_upto(len(text[: found[0]].rstrip(_C_SPACE)))
            calls = self._calls_if_closed()
            return _merge(content, calls)
        return self._calls_if_closed()

    def _content_upto(self, cut: int) -> DeltaMessage | None:
        if cut <= self._sent:
            return None
        delta = DeltaMessage(content=self._text[self._sent : cut])
        self._sent = cut
        return delta

    def _calls_if_closed(self) -> DeltaMessage | None:
        """The block's calls once it is closed; its text as content if it closed malformed."""
        tail = self._text[self._block_at :]
        if not any(end in tail for end in _BLOCK_ENDS):
            return None
        parsed = parse_tool_calls(self._text)
        if parsed.raw_dsml is None:
            self._block_at = None  # malformed: the text is content after all
            self._done = True
            return self._content_upto(len(self._text))
        self._done = True
        ids = call_ids_for(self._request, parsed.raw_dsml, len(parsed.calls))
        self.serving.tool_memory.remember_calls(ids, parsed.raw_dsml)
        deltas = []
        for index, (tool_id, call) in enumerate(zip(ids, parsed.calls, strict=True)):
            deltas.append(
                DeltaToolCall(
                    index=index,
                    id=tool_id,
                    type="function",
                    function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                )
            )
            self.prev_tool_call_arr.append({"name": call.name, "arguments": call.arguments})
            self.streamed_args_for_tool.append(call.arguments)
        self.current_tool_id = len(parsed.calls) - 1
        return DeltaMessage(tool_calls=deltas) if deltas else None

    def finish_streaming(self) -> DeltaMessage | None:
        """End of the stream: held-back text (no block came, or it never closed) is content."""
        if self._done:
            return None
        self._done = True
        return self._content_upto(len(self._text))


def _merge(first: DeltaMessage | None, second: DeltaMessage | None) -> DeltaMessage | None:
    if first is None or second is None:
        return first or second
    first.tool_calls = list(first.tool_calls) + list(second.tool_calls)
    first.content = (first.content or "") + (second.content or "") or None
    return first
