"""vLLM's thinking switches (`chat_template_kwargs`) steer the ds4 rendering; the engine's fields win."""

from __future__ import annotations

import pytest

from ds4_vllm.chat.anthropic_request import render_anthropic_messages
from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.fields import RenderError
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.thinking import ThinkMode

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("extra", "mode"),
    [
        ({}, ThinkMode.HIGH),
        ({"chat_template_kwargs": {"thinking": False}}, ThinkMode.NONE),
        ({"chat_template_kwargs": {"enable_thinking": False}}, ThinkMode.NONE),
        ({"chat_template_kwargs": {"reasoning_effort": "none"}}, ThinkMode.NONE),
        ({"chat_template_kwargs": {"reasoning_effort": "max"}}, ThinkMode.MAX),
        ({"chat_template_kwargs": {"thinking": False}, "thinking": {"type": "enabled"}}, ThinkMode.HIGH),
        ({"chat_template_kwargs": {"thinking": True}, "think": False}, ThinkMode.NONE),
        ({"chat_template_kwargs": {"thinking": True}, "model": "deepseek-chat"}, ThinkMode.HIGH),
        ({"chat_template_kwargs": {"thinking": "no"}}, ThinkMode.HIGH),  # not a boolean: ignored
    ],
)
def test_chat_completion_think_mode(extra: dict, mode: ThinkMode) -> None:
    rendered = render_chat_completion({"messages": USER, **extra}, ctx_size=400_000)
    assert rendered.think_mode is mode
    assert rendered.text.endswith("<think>" if mode.enabled else "</think>")


def test_anthropic_and_responses_read_it_too() -> None:
    off = {"chat_template_kwargs": {"thinking": False}}
    assert render_anthropic_messages({"messages": USER, **off}, ctx_size=4096).think_mode is ThinkMode.NONE
    assert render_responses({"input": "hi", **off}, ctx_size=4096).think_mode is ThinkMode.NONE
    with pytest.raises(
        RenderError, match="chat_template_kwargs.reasoning_effort: unknown reasoning effort 'huge'"
    ):
        render_chat_completion(
            {"messages": USER, "chat_template_kwargs": {"reasoning_effort": "huge"}}, ctx_size=1
        )
