"""Forcing the model to sample exact bytes (a DSML tool-call block) with vLLM's structured outputs."""

from __future__ import annotations

_REGEX_SPECIAL = set(".^$*+?()[]{}|\\/")


def regex_for(text: str) -> str:
    """A regex matching exactly `text`: sent as `structured_outputs.regex`, it makes the model
    sample these bytes (in whatever tokens it prefers)."""
    return "".join("\\n" if c == "\n" else ("\\" + c if c in _REGEX_SPECIAL else c) for c in text)


def forced(text: str) -> dict:
    """`extra_body` for a chat request that samples exactly `text` with thinking off."""
    return {"chat_template_kwargs": {"thinking": False}, "structured_outputs": {"regex": regex_for(text)}}
