"""Register the `ds4` tool-call and reasoning parsers with vLLM (by name, imported when first used)."""

from __future__ import annotations

PARSER_NAME = "ds4"
TOOL_PARSER = ("ds4_vllm.serving.tool_parser", "Ds4ToolParser")
REASONING_PARSER = ("ds4_vllm.serving.reasoning_parser", "Ds4ReasoningParser")


def register_parsers() -> None:
    """`--tool-call-parser ds4` and `--reasoning-parser ds4` (idempotent, imports nothing heavy)."""
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    ToolParserManager.register_lazy_module(PARSER_NAME, *TOOL_PARSER)
    ReasoningParserManager.register_lazy_module(PARSER_NAME, *REASONING_PARSER)
