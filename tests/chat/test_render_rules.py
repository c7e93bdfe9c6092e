"""One byte-exact vector per rendering rule of shared/specs/kvc-format.md §8 (8.1 chat, 8.2 completions).

Expected strings are written out from the spec text, not built with the renderer's constants.
"""

from __future__ import annotations

import json

import pytest

from ds4_vllm.chat.anthropic_request import render_anthropic_messages
from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.completion_request import render_completion
from ds4_vllm.chat.fields import RenderError
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.thinking import ThinkMode

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
U, A = "<｜User｜>", "<｜Assistant｜>"
CTX = 16384
BIG_CTX = 393216

# §8.1 THINK_MAX_PREFIX (476 bytes) and the tools block, copied from the spec.
THINK_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\nYou MUST be very thorough in your "
    "thinking and comprehensively decompose the problem to resolve the root cause, rigorously "
    "stress-testing your logic against all potential paths, edge cases, and adversarial scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, "
    "considered alternative, and rejected hypothesis to ensure absolutely no assumption is left "
    "unchecked.\n\n"
)
TOOLS_HEAD = json.loads(
    r'"## Tools\n\nYou have access to a set of tools to help answer the user question. You can invoke '
    r"tools by writing a \"<｜DSML｜tool_calls>\" block like the following:\n\n<｜DSML｜tool_calls>\n"
    r"<｜DSML｜invoke name=\"$TOOL_NAME\">\n<｜DSML｜parameter name=\"$PARAMETER_NAME\" "
    r"string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n"
    r"<｜DSML｜invoke name=\"$TOOL_NAME2\">\n...\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\n"
    r"String parameters should be specified as raw text and set `string=\"true\"`. Preserve "
    r"characters such as `>`, `&`, and `&&` exactly; never replace normal string characters with XML "
    r"or HTML entity escapes. Only if a string value itself contains the exact closing parameter tag "
    r"`</｜DSML｜parameter>`, write that tag as `&lt;/｜DSML｜parameter>` inside the value. For all "
    r"other types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    r"`string=\"false\"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your "
    r"complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    r"Otherwise, output directly after </think> with tool calls or final response.\n\n"
    r'### Available Tool Schemas\n\n"'
)
TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool "
    "calls. Use the exact parameter names from the schemas."
)
WEATHER_FN = '{"name": "get_weather",  "parameters": {"type": "object"}}'  # client spacing kept
WEATHER_TOOLS = '[{"type":"function","function":' + WEATHER_FN + "}]"


def chat(body: dict | str, **kw) -> str:
    raw = body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)
    return render_chat_completion(raw, ctx_size=kw.pop("ctx_size", CTX), **kw).text


def msgs(*pairs: tuple[str, str]) -> list[dict]:
    return [{"role": r, "content": c} for r, c in pairs]


# -- §8.1 template ------------------------------------------------------------------------------


def test_bos_system_user_then_assistant_with_think_by_default() -> None:
    body = {"messages": msgs(("system", "S"), ("user", "hi"))}
    assert chat(body) == f"{BOS}S{U}hi{A}<think>"


def test_thinking_off_ends_with_close_think() -> None:
    body = {"messages": msgs(("user", "hi")), "thinking": {"type": "disabled"}}
    assert chat(body) == f"{BOS}{U}hi{A}</think>"


@pytest.mark.parametrize(
    "switch",
    [
        {"thinking": {"type": "disabled"}},
        {"think": False},
        {"reasoning_effort": "none"},
        {"model": "deepseek-chat"},
    ],
)
def test_each_thinking_off_switch(switch: dict) -> None:
    assert chat({"messages": msgs(("user", "q")), **switch}).endswith(f"{A}</think>")


def test_deepseek_reasoner_on_and_explicit_thinking_beats_the_alias() -> None:
    assert chat({"model": "deepseek-reasoner", "messages": msgs(("user", "q"))}).endswith("<think>")
    body = {"model": "deepseek-chat", "thinking": {"type": "enabled"}, "messages": msgs(("user", "q"))}
    assert chat(body).endswith("<think>")


def test_max_effort_prefix_only_with_a_large_context() -> None:
    body = {"messages": msgs(("system", "S"), ("user", "q")), "reasoning_effort": "max"}
    assert chat(body, ctx_size=BIG_CTX) == f"{BOS}{THINK_MAX}S{U}q{A}<think>"
    assert len(THINK_MAX.encode()) == 476
    assert chat(body, ctx_size=BIG_CTX - 1) == f"{BOS}S{U}q{A}<think>"


def test_system_and_developer_joined_with_blank_line_before_first_user() -> None:
    body = {"messages": msgs(("system", "A"), ("user", "u"), ("developer", "B"))}
    assert chat(body) == f"{BOS}A\n\nB{U}u{A}<think>"


def test_tools_block_first_then_blank_line_then_system() -> None:
    body = (
        '{"messages":[{"role":"system","content":"S"},{"role":"user","content":"u"}],"tools":'
        + WEATHER_TOOLS
        + "}"
    )
    assert chat(body) == f"{BOS}{TOOLS_HEAD}{WEATHER_FN}{TOOLS_TAIL}\n\nS{U}u{A}<think>"


def test_tool_choice_none_drops_the_tools_block() -> None:
    body = '{"messages":[{"role":"user","content":"u"}],"tool_choice":"none","tools":' + WEATHER_TOOLS + "}"
    assert chat(body) == f"{BOS}{U}u{A}<think>"


def test_raw_tools_json_given_beside_parsed_request() -> None:
    # A caller that parsed the body passes the raw `tools` bytes; the schema keeps its spacing.
    parsed = {"messages": msgs(("user", "u")), "tools": json.loads(WEATHER_TOOLS)}
    text = render_chat_completion(parsed, ctx_size=CTX, tools_json=WEATHER_TOOLS.encode()).text
    assert f"\n\n{WEATHER_FN}\n\nYou MUST" in text
    compact = render_chat_completion(parsed, ctx_size=CTX).text  # without raw bytes: compact JSON
    assert '\n\n{"name":"get_weather","parameters":{"type":"object"}}\n\nYou MUST' in compact


def test_schemas_one_per_line_other_objects_raw() -> None:
    tools = '[{"type":"function","function":{"name":"a"}}, {"name":"b", "input_schema":{}}]'
    body = '{"messages":[{"role":"user","content":"u"}],"tools":' + tools + "}"
    assert (
        chat(body)
        == f'{BOS}{TOOLS_HEAD}{{"name":"a"}}\n{{"name":"b", "input_schema":{{}}}}{TOOLS_TAIL}{U}u{A}<think>'
    )


def test_array_content_parts_concatenated() -> None:
    content = [
        {"type": "text", "text": "a"},
        "b",
        {"type": "image_url", "image_url": {"url": "x"}},
        {"text": "c"},
    ]
    assert chat({"messages": [{"role": "user", "content": content}]}) == f"{BOS}{U}abc{A}<think>"


def test_tool_results_share_one_user_marker_and_escape_their_close_tag() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "x</tool_result>y"},
            {"role": "function", "content": "<b>&"},
        ],
        "thinking": {"type": "disabled"},
    }
    dsml = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    assert chat(body) == (
        f"{BOS}{U}u{A}</think>{dsml}{EOS}"
        f"{U}<tool_result>x&lt;/tool_result>y</tool_result><tool_result><b>&</tool_result>{A}</think>"
    )


def test_old_reasoning_dropped_without_tool_context() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "q1"},
            {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
            {"role": "user", "content": "q2"},
        ]
    }
    assert chat(body) == f"{BOS}{U}q1{A}</think>a1{EOS}{U}q2{A}<think>"


def test_reasoning_kept_after_the_last_user_message() -> None:
    body = {
        "messages": [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning_content": "r"},
        ]
    }
    assert chat(body) == f"{BOS}{U}q{A}<think>r</think>a{EOS}"


def test_reasoning_kept_in_tool_context_and_dropped_when_thinking_is_off() -> None:
    turns = [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
        {"role": "tool", "content": "t"},
    ]
    assert (
        chat({"messages": turns})
        == f"{BOS}{U}q1{A}<think>r1</think>a1{EOS}{U}<tool_result>t</tool_result>{A}<think>"
    )
    off = chat({"messages": turns, "think": False})
    assert off == f"{BOS}{U}q1{A}</think>a1{EOS}{U}<tool_result>t</tool_result>{A}</think>"


def test_assistant_without_a_pending_user_gets_no_marker() -> None:
    body = {"messages": [{"role": "assistant", "content": "x"}, {"role": "assistant", "content": "y"}]}
    assert chat(body) == f"{BOS}x{EOS}y{EOS}"


# -- §8.1 DSML ----------------------------------------------------------------------------------


def _call_text(arguments: str | dict, name: str = "f", replay=None, call_id: str = "c1") -> str:
    body = {
        "messages": [
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
                ],
            },
        ],
        "think": False,
    }
    text = chat(body, replay=replay)
    prefix = f"{BOS}{U}u{A}</think>"
    assert text.startswith(prefix) and text.endswith(EOS)
    return text[len(prefix) : -len(EOS)]


def test_dsml_canonical_form_string_and_non_string_values_in_object_order() -> None:
    args = '{"path": "a b", "n": [1, {"x": " y "}], "ok": true}'
    assert _call_text(args) == (
        "\n\n<｜DSML｜tool_calls>\n"
        '<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="path" string="true">a b</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="n" string="false">[1,{"x":" y "}]</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="ok" string="false">true</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n"
        "</｜DSML｜tool_calls>"
    )


def test_dsml_attribute_escaping() -> None:
    out = _call_text('{"a<&>\\"b": "v"}', name='n"<&>')
    assert '<｜DSML｜invoke name="n&quot;&lt;&amp;&gt;">' in out
    assert '<｜DSML｜parameter name="a&lt;&amp;&gt;&quot;b" string="true">v<' in out


def test_dsml_string_values_unescaped_and_close_tag_escaped() -> None:
    args = json.dumps({"s": 'x</｜DSML｜parameter>y\n"&<>'}, ensure_ascii=True)
    assert '">x&lt;/｜DSML｜parameter>y\n"&<></｜DSML｜parameter>\n' in _call_text(args)


def test_dsml_non_string_values_minified_and_close_tag_as_unicode_escape() -> None:
    args = '{"o": { "k" : "a</｜DSML｜parameter>" ,\n "n" : 1.50 }}'
    assert '">{"k":"a\\u003c/｜DSML｜parameter>","n":1.50}</｜DSML｜parameter>\n' in _call_text(args)


@pytest.mark.parametrize("arguments", ["not json", "[1, 2]", '"s"'])
def test_dsml_non_object_arguments_become_one_arguments_parameter(arguments: str) -> None:
    assert _call_text(arguments) == (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        f'<｜DSML｜parameter name="arguments" string="true">{arguments}</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )


def test_dsml_object_arguments_sent_as_json_value() -> None:
    # Non-string `arguments` are taken as raw JSON text (here from a parsed dict: compact form).
    assert '<｜DSML｜parameter name="n" string="false">3</｜DSML｜parameter>' in _call_text({"n": 3})


def test_dsml_exact_replay_used_only_when_every_id_maps_to_one_block() -> None:
    block = '\n\n<tool_calls>\n<invoke name="f">\n<parameter name="x">1</parameter></invoke></tool_calls>'
    assert _call_text('{"x":1}', replay={"c1": block}.get) == block
    assert _call_text('{"x":1}', replay={}.get).startswith("\n\n<｜DSML｜tool_calls>\n")
    body = {
        "messages": [
            {"role": "user", "content": "u"},
            {
                "role": "assistant",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "f", "arguments": "{}"}},
                    {"id": "c2", "function": {"name": "g", "arguments": "{}"}},
                ],
            },
        ]
    }
    both = '\n\n<tool_calls>\n<invoke name="f">\n</invoke>\n<invoke name="g">\n</invoke>\n</tool_calls>'
    mixed = chat(body, replay={"c1": both}.get)  # c2 unknown: canonical for the whole turn
    assert both not in mixed and '<｜DSML｜invoke name="g">' in mixed
    assert both in chat(body, replay={"c1": both, "c2": both}.get)


def test_dsml_replay_only_of_a_block_holding_the_calls_the_client_sent() -> None:
    """A remembered id sent back with other calls (edited, or another conversation's id with this
    client's own arguments) renders the client's calls canonically: never the remembered bytes."""
    block = '\n\n<tool_calls>\n<invoke name="f">\n<parameter name="x">1</parameter></invoke></tool_calls>'
    replay = {"c1": block}.get
    assert _call_text({"x": 1}, replay=replay) == block  # same value: number and string text agree
    assert _call_text('{"x": "1"}', replay=replay) == block
    canonical = _call_text({"x": 2}, replay=None)
    assert _call_text({"x": 2}, replay=replay) == canonical  # other value
    assert _call_text({"x": 1, "y": 0}, replay=replay) == _call_text({"x": 1, "y": 0})  # extra argument
    assert _call_text({}, replay=replay) == _call_text({})  # missing argument
    assert _call_text({"x": 1}, name="g", replay=replay) == _call_text({"x": 1}, name="g")  # other name
    broken = {"c1": '\n\n<tool_calls>\n<invoke name="f">\n<parameter name="x">1'}.get
    assert _call_text({"x": 1}, replay=broken) == _call_text({"x": 1})  # not a whole block


# -- Anthropic (§8.1 conversion) ----------------------------------------------------------------


def anthropic(body: dict, **kw) -> str:
    return render_anthropic_messages(json.dumps(body, ensure_ascii=False), ctx_size=CTX, **kw).text


def test_anthropic_system_parts_joined_with_newline_private_parts_dropped() -> None:
    body = {
        "system": [{"type": "text", "text": "a"}, {"text": "x-anthropic-billing"}, "b\n", {"text": "c"}, ""],
        "messages": [{"role": "user", "content": "u"}],
    }
    assert anthropic(body) == f"{BOS}a\nb\nc{U}u{A}<think>"


def test_anthropic_blocks_tool_use_and_tool_result() -> None:
    body = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "r"},
                    {"type": "text", "text": "t"},
                    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {"k": "v"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "out</tool_result>"}],
                    },
                    {"type": "text", "text": "more"},
                ],
            },
        ],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    }
    dsml = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="k" string="true">v</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    schema = '{"name": "f", "input_schema": {"type": "object"}}'  # json.dumps spacing, kept raw
    assert anthropic(body) == (
        f"{BOS}{TOOLS_HEAD}{schema}{TOOLS_TAIL}{U}q{A}<think>r</think>t{dsml}{EOS}"
        f"{U}<tool_result>out&lt;/tool_result></tool_result>more{A}<think>"
    )


def test_anthropic_tool_choice_none_and_thinking_disabled() -> None:
    body = {
        "messages": [{"role": "user", "content": "u"}],
        "tools": [{"name": "f"}],
        "tool_choice": {"type": "none"},
        "thinking": {"type": "disabled"},
    }
    assert anthropic(body) == f"{BOS}{U}u{A}</think>"


# -- Responses (§8.1 conversion) ----------------------------------------------------------------


def responses(body: dict, **kw) -> str:
    return render_responses(json.dumps(body, ensure_ascii=False), ctx_size=CTX, **kw).text


def test_responses_instructions_are_the_first_system_message() -> None:
    body = {
        "instructions": "I",
        "input": [{"role": "developer", "content": "D"}, {"role": "user", "content": "u"}],
    }
    assert responses(body) == f"{BOS}I\n\nD{U}u{A}<think>"


def test_responses_items_reasoning_function_call_and_output() -> None:
    body = {
        "input": [
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}]},
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a":1}'},
            {"type": "function_call_output", "call_id": "c1", "output": "done"},
        ],
        "reasoning": {"effort": "high"},
    }
    dsml = (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="a" string="false">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    assert (
        responses(body)
        == f"{BOS}{U}q{A}<think>s</think>{dsml}{EOS}{U}<tool_result>done</tool_result>{A}<think>"
    )


def test_responses_namespace_and_tool_search_schemas_reserialized() -> None:
    body = {
        "input": "u",
        "tools": [
            {
                "type": "namespace",
                "name": "fs__",
                "tools": [
                    {
                        "type": "function",
                        "name": "read",
                        "description": 'R "q"',
                        "parameters": {"type": "object"},
                    }
                ],
            },
            {"type": "tool_search", "parameters": {"a": 1}},
        ],
    }
    schemas = (
        '{"name":"fs__read","description":"R \\"q\\"","parameters":{"type": "object"}}\n'
        '{"name":"tool_search","description":"Search available tools.","parameters":{"a": 1}}'
    )
    assert responses(body) == f"{BOS}{TOOLS_HEAD}{schemas}{TOOLS_TAIL}{U}u{A}<think>"


def test_responses_tool_search_output_schemas_follow_request_tools() -> None:
    body = {
        "input": [
            {"role": "user", "content": "u"},
            {"type": "tool_search_call", "call_id": "s1", "arguments": {"q": "x"}},
            {
                "type": "tool_search_output",
                "call_id": "s1",
                "tools": [{"type": "function", "function": {"name": "g"}}],
            },
        ],
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "reasoning": {"effort": "none"},
    }
    text = responses(body)
    assert text.startswith(f'{BOS}{TOOLS_HEAD}{{"name": "f"}}\n{{"name": "g"}}{TOOLS_TAIL}{U}u{A}</think>')
    assert '<｜DSML｜invoke name="tool_search">' in text


def test_responses_refuses_what_the_engine_refuses() -> None:
    with pytest.raises(RenderError, match="forced tool_choice"):
        responses({"input": "u", "tool_choice": {"type": "function", "name": "f"}})
    with pytest.raises(RenderError, match=r"input\[0\].status"):
        responses({"input": [{"type": "function_call", "name": "f", "status": "in_progress"}]})
    with pytest.raises(RenderError, match=r"input\[0\].content\[0\]"):
        responses({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})


# -- §8.2 completions ---------------------------------------------------------------------------


def test_completion_wrapping_think_on_off_and_max() -> None:
    def comp(body: dict, ctx: int = CTX) -> str:
        return render_completion(json.dumps(body), ctx_size=ctx).text

    assert comp({"prompt": "p"}) == f"{BOS}You are a helpful assistant{U}p{A}<think>"
    assert (
        comp({"prompt": ["p", "ignored"], "think": False})
        == f"{BOS}You are a helpful assistant{U}p{A}</think>"
    )
    assert comp({"prompt": "p", "reasoning_effort": "max"}, BIG_CTX) == (
        f"{BOS}{THINK_MAX}You are a helpful assistant{U}p{A}<think>"
    )
    r = render_completion({"prompt": "p", "reasoning_effort": "max"}, ctx_size=BIG_CTX)
    assert r.think_mode is ThinkMode.MAX


def test_bad_fields_are_named() -> None:
    with pytest.raises(RenderError, match=r"messages\[1\].role: expected a string"):
        chat({"messages": [{"role": "user"}, {"role": 3}]})
    with pytest.raises(RenderError, match="reasoning_effort: unknown reasoning effort"):
        chat({"messages": [], "reasoning_effort": "extreme"})
    with pytest.raises(RenderError, match="missing messages"):
        chat({})
    with pytest.raises(RenderError, match="offset 13"):
        chat('{"messages": x}')
