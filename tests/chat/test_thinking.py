"""The think-mode precedence of `ds4_vllm.chat.thinking`, step by step, on every API's renderer.

Each case is a request body as a client writes it (JSON text, so the key order is the client's)
and the think mode the prompt must end in. Where two of the engine's fields disagree, the later
one in the body wins, as in the engine's parsers (`parse_chat_request` and friends read the JSON
object in order and overwrite).
"""

from __future__ import annotations

import json

import pytest

from ds4_vllm.chat.anthropic_request import render_anthropic_messages
from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.completion_request import render_completion
from ds4_vllm.chat.fields import RenderError
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.thinking import THINK_MAX_MIN_CONTEXT, ThinkMode

BIG = THINK_MAX_MIN_CONTEXT
USER = [{"role": "user", "content": "q"}]


def chat(fields: str, ctx: int = BIG, **kw) -> ThinkMode:
    return render_chat_completion(
        f'{{"messages": {json.dumps(USER)}{fields}}}', ctx_size=ctx, **kw
    ).think_mode


def completion(fields: str, ctx: int = BIG) -> ThinkMode:
    return render_completion(f'{{"prompt": "p"{fields}}}', ctx_size=ctx).think_mode


def anthropic(fields: str, ctx: int = BIG, **kw) -> ThinkMode:
    body = f'{{"messages": {json.dumps(USER)}{fields}}}'
    return render_anthropic_messages(body, ctx_size=ctx, **kw).think_mode


def responses(fields: str, ctx: int = BIG, **kw) -> ThinkMode:
    return render_responses(f'{{"input": "q"{fields}}}', ctx_size=ctx, **kw).think_mode


NONE, HIGH, MAX = ThinkMode.NONE, ThinkMode.HIGH, ThinkMode.MAX


@pytest.mark.parametrize("render", [chat, completion])
@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ("", HIGH),  # step 1
        (', "reasoning_effort": "max"', MAX),
        (', "reasoning_effort": null', HIGH),
        (', "reasoning_effort": "none"', NONE),
        (', "thinking": false', NONE),
        (', "thinking": {"type": "disabled"}', NONE),
        (', "thinking": {"budget_tokens": 9}', HIGH),  # no type: left as it is, but counts as a switch
        (', "think": false', NONE),
        # step 4: the later field wins
        (', "thinking": {"type": "enabled"}, "think": false', NONE),
        (', "think": false, "thinking": {"type": "enabled"}', HIGH),
        (', "thinking": false, "think": true, "thinking": false', NONE),  # a repeated key: its last place
        # an effort is no switch on chat: it cannot turn thinking back on
        (', "think": false, "reasoning_effort": "max"', NONE),
        # step 2 and 4: vLLM's kwargs first, the engine's fields override them
        (', "chat_template_kwargs": {"thinking": false}, "reasoning_effort": "high"', NONE),
        (', "chat_template_kwargs": {"enable_thinking": true, "thinking": false}', NONE),
        (', "think": true, "chat_template_kwargs": {"thinking": false}', HIGH),
        # step 5: aliases only without a switch
        (', "model": "deepseek-chat"', NONE),
        (', "model": "deepseek-chat", "reasoning_effort": "max"', NONE),
        (', "model": "deepseek-chat", "thinking": {"type": "enabled"}', HIGH),
        (', "model": "deepseek-chat", "chat_template_kwargs": {"thinking": true}', HIGH),
        (', "model": "deepseek-reasoner", "chat_template_kwargs": {"reasoning_effort": "none"}', NONE),
        (', "model": "deepseek-reasoner", "reasoning_effort": "none"', NONE),
        (', "model": "deepseek-reasoner"', HIGH),
    ],
)
def test_chat_and_completion(render, fields: str, mode: ThinkMode) -> None:
    assert render(fields) is mode


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ("", HIGH),
        (', "thinking": {"type": "disabled"}', NONE),
        (', "think": false', HIGH),  # not an Anthropic field
        (', "output_config": {"effort": "max"}', MAX),
        (', "output_config": {"effort": "none"}', NONE),
        (', "reasoning_effort": "max", "output_config": {"effort": "high"}', HIGH),  # the later effort
        (', "output_config": {"effort": "high"}, "reasoning_effort": "max"', MAX),
        (', "model": "deepseek-chat", "output_config": {"effort": "max"}', NONE),
        (', "model": "deepseek-chat", "thinking": {"type": "enabled"}', HIGH),
    ],
)
def test_anthropic(fields: str, mode: ThinkMode) -> None:
    assert anthropic(fields) is mode


@pytest.mark.parametrize(
    ("fields", "mode"),
    [
        ("", HIGH),
        (', "reasoning": {"effort": "max"}', MAX),
        (', "reasoning": {"effort": "none"}', NONE),
        (', "reasoning": {"effort": null}', HIGH),
        (
            ', "thinking": {"type": "disabled"}, "think": false, "reasoning_effort": "none"',
            HIGH,
        ),  # not Responses fields
        # on Responses the effort is the switch: it overrides vLLM's, and the alias
        (', "model": "deepseek-chat", "reasoning": {"effort": "high"}', HIGH),
        (', "model": "deepseek-chat", "reasoning": {"summary": "auto"}', NONE),
        (', "chat_template_kwargs": {"thinking": false}, "reasoning": {"effort": "high"}', HIGH),
        (', "chat_template_kwargs": {"thinking": false}, "reasoning": {"summary": "auto"}', NONE),
    ],
)
def test_responses(fields: str, mode: ThinkMode) -> None:
    assert responses(fields) is mode


def test_the_servers_vllm_switch_is_step_3_on_every_api() -> None:
    """`vllm_switch` overrides the request's kwargs and the alias, and the engine's fields override it."""
    assert chat("", vllm_switch=False) is NONE
    assert chat(', "chat_template_kwargs": {"thinking": true}', vllm_switch=False) is NONE
    assert chat(', "thinking": true', vllm_switch=False) is HIGH
    assert chat(', "model": "deepseek-chat"', vllm_switch=True) is HIGH
    assert anthropic("", vllm_switch=False) is NONE
    assert anthropic(', "thinking": {"type": "enabled"}', vllm_switch=False) is HIGH
    assert responses("", vllm_switch=False) is NONE
    assert responses(', "reasoning": {"summary": "detailed"}', vllm_switch=False) is NONE
    assert responses(', "reasoning": {"effort": "low"}', vllm_switch=False) is HIGH
    assert responses(', "model": "deepseek-chat"', vllm_switch=True) is HIGH


def test_max_needs_the_big_context_on_every_api() -> None:
    assert chat(', "reasoning_effort": "max"', ctx=BIG - 1) is HIGH
    assert completion(', "reasoning_effort": "max"', ctx=BIG - 1) is HIGH
    assert anthropic(', "output_config": {"effort": "max"}', ctx=BIG - 1) is HIGH
    assert responses(', "reasoning": {"effort": "max"}', ctx=BIG - 1) is HIGH
    assert responses(', "chat_template_kwargs": {"reasoning_effort": "max"}') is MAX


@pytest.mark.parametrize(
    ("render", "fields", "message"),
    [
        (chat, ', "think": "yes"', "think: expected true or false"),
        (chat, ', "thinking": {"type": 1}', "thinking.type: expected a string, got RawNumber"),
        (chat, ', "reasoning_effort": "huge"', "reasoning_effort: unknown reasoning effort 'huge'"),
        (
            anthropic,
            ', "output_config": {"effort": "huge"}',
            "output_config.effort: unknown reasoning effort",
        ),
        (responses, ', "reasoning": {"effort": 2}', "reasoning.effort: unknown reasoning effort 2"),
    ],
)
def test_bad_fields_are_named(render, fields: str, message: str) -> None:
    with pytest.raises(RenderError, match=message.replace(".", r"\.")):
        render(fields)
