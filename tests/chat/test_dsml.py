"""Generated DSML -> tool calls, as the ds4 engine parses its output (ds4_vllm/chat/dsml.py)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds4_vllm.chat.dsml import (
    ParsedToolCall,
    dsml_tool_calls,
    dsml_unescape,
    find_block_start,
    parse_generated,
    parse_tool_calls,
    split_reasoning,
)
from ds4_vllm.chat.messages import ToolCall

P_CLOSE = "</｜DSML｜parameter>"

WEATHER = (
    "\n\n<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris &amp; &lt;Lyon&gt; &quot;x&quot; &apos;y&apos; &copy;'
    + P_CLOSE
    + "\n"
    '<｜DSML｜parameter name="days" string="false">  3 ' + P_CLOSE + "\n"
    '<｜DSML｜parameter name="opts" string="false">{ "units" : "metric", "list": [1, 2] }' + P_CLOSE + "\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="a&amp;b">\n'
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>"
)


def test_block_becomes_calls_with_exact_raw_bytes() -> None:
    parsed = parse_generated("Let me check. \n" + WEATHER)
    assert parsed.content == "Let me check."  # trailing whitespace before the block is trimmed
    assert parsed.reasoning is None
    assert parsed.raw_dsml == WEATHER
    assert parsed.calls == (
        ParsedToolCall(
            "get_weather",
            '{"city":"Paris & <Lyon> \\"x\\" \'y\' &copy;","days":3,"opts":{"units":"metric","list":[1,2]}}',
        ),
        ParsedToolCall("a&b", "{}"),
    )
    json.loads(parsed.calls[0].arguments)  # arguments are always valid JSON


def test_reasoning_split_and_dsml_inside_reasoning_is_not_a_call() -> None:
    text = "<think>maybe " + WEATHER + " no</think>ok"
    parsed = parse_generated(text)
    assert parsed.reasoning == "maybe " + WEATHER + " no"
    assert (parsed.content, parsed.calls, parsed.raw_dsml) == ("ok", (), None)
    # without </think> everything is content, as in the engine
    assert split_reasoning("no think here") == (None, "no think here")
    parsed = parse_generated("thought</think>\n\n" + WEATHER[2:])
    assert parsed.reasoning == "thought" and parsed.content == "" and len(parsed.calls) == 2
    assert parsed.raw_dsml == WEATHER  # the blank line after </think> belongs to the block


def test_non_string_values_that_are_not_json_become_strings() -> None:
    block = (
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n'
        '<｜DSML｜parameter name="a" string="false">not json' + P_CLOSE + "\n"
        '<｜DSML｜parameter name="b" string="false">' + P_CLOSE + "\n"
        '<｜DSML｜parameter name="c" string="false">1.50' + P_CLOSE + "\n"
        '<｜DSML｜parameter name="d" string="false">true' + P_CLOSE + "\n"
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    )
    (call,) = parse_tool_calls(block).calls
    assert call.arguments == '{"a":"not json","b":null,"c":1.50,"d":true}'  # 1.50 keeps its spelling
    assert json.loads(call.arguments) == {"a": "not json", "b": None, "c": 1.5, "d": True}


def test_other_spellings_and_nested_parameters() -> None:
    plain = (
        '\n\n<tool_calls>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
        '<parameter name="where">\n<parameter name="lat" string="false">1</parameter>'
        '<parameter name="tag">x &amp; y</parameter>\n</parameter>\n</invoke>\n</tool_calls>'
    )
    parsed = parse_tool_calls("Sure" + plain + " trailing text is dropped")
    assert parsed.content == "Sure" and parsed.raw_dsml == plain
    assert parsed.calls == (
        ParsedToolCall("get_weather", '{"city":"Paris","where":{"lat":1,"tag":"x & y"}}'),
    )
    short = '<DSML｜tool_calls><DSML｜invoke name="f"></DSML｜invoke></DSML｜tool_calls>'
    assert parse_tool_calls(short).calls == (ParsedToolCall("f", "{}"),)


def test_earliest_block_wins_and_blank_line_is_included() -> None:
    assert find_block_start("ab\n\n<tool_calls>x<｜DSML｜tool_calls>") == (2, 2)
    assert find_block_start("ab\n<｜DSML｜tool_calls>") == (3, 0)
    assert find_block_start("nothing") is None


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            WEATHER[: WEATHER.index("</｜DSML｜invoke>")],
            "expected a parameter of 'get_weather', found the end",
        ),
        (WEATHER[:-5], "expected an invoke or the block's end"),
        ("<｜DSML｜tool_calls>\n<｜DSML｜invoke>\n", "offset 25: invoke without a name"),
        ('<｜DSML｜tool_calls><｜DSML｜invoke name="f"><｜DSML｜parameter name="x">v', "'x' is not closed"),
        ("<｜DSML｜tool_calls>\nhello", "offset 25: expected an invoke or the block's end, found 'hello'"),
    ],
)
def test_malformed_block_leaves_all_text_as_content(text: str, error: str) -> None:
    parsed = parse_generated("<think>r</think>before" + text)
    assert parsed.calls == () and parsed.raw_dsml is None
    assert parsed.content == "<think>r</think>before" + text and parsed.reasoning is None
    assert error in parsed.error


def test_unescape_knows_only_five_entities() -> None:
    assert dsml_unescape("&amp;lt; &lt;&gt;&quot;&apos; &nbsp; & &amp") == "&lt; <>\"' &nbsp; & &amp"


_text = st.text(st.characters(blacklist_characters="&\0", blacklist_categories=("Cs",)), max_size=20)
_json_leaf = st.one_of(st.integers(-(10**6), 10**6), st.booleans(), st.none(), _text)
_values = st.one_of(_text, st.integers(), st.booleans(), st.lists(_json_leaf, max_size=3))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.text(min_size=1, max_size=8), st.dictionaries(_text, _values, max_size=4)), max_size=3
    )
)
def test_canonical_render_then_parse_then_render_is_stable(calls: list[tuple[str, dict]]) -> None:
    """parse(render(args)) renders back to the same bytes: the canonical form is a stable cache key.
    (A string holding a literal entity such as "&lt;" is the engine's known exception.)"""
    tool_calls = [
        ToolCall(None, name, json.dumps(args, ensure_ascii=False, separators=(",", ":")))
        for name, args in calls
    ]
    block = dsml_tool_calls(tool_calls)
    parsed = parse_tool_calls("x" + block)
    if not calls:
        assert parsed.calls == ()
        return
    assert parsed.raw_dsml == block
    assert [json.loads(c.arguments) for c in parsed.calls] == [args for _, args in calls]
    rerendered = dsml_tool_calls([ToolCall(None, c.name, c.arguments) for c in parsed.calls])
    assert rerendered == block


def test_string_holding_the_closing_tag_round_trips() -> None:
    args = json.dumps({"code": f"a{P_CLOSE}b", "n": [f"{P_CLOSE}"]}, ensure_ascii=False)
    block = dsml_tool_calls([ToolCall(None, "f", args)])
    assert "&lt;/｜DSML｜parameter>" in block and "\\u003c/｜DSML｜parameter>" in block
    (call,) = parse_tool_calls(block).calls
    assert json.loads(call.arguments) == json.loads(args)
