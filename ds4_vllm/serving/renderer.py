"""vLLM renderer mode `ds4`: prompts rendered by `ds4_vllm.chat`, byte for byte the engine's.

vLLM hands a renderer parsed messages (and, for /v1/messages and /v1/responses, messages it has
already converted to chat form). The ds4 engine renders each API's own request JSON, including
the client's raw tool-schema bytes, so on the HTTP routes this renderer ignores vLLM's messages
and renders the raw body of the request (`ds4_vllm.serving.request_body`) with the engine's
parser for that route:

- /v1/chat/completions (and its /render, /tokenize)  `render_chat_completion`
- /v1/messages (and /render, /count_tokens)          `render_anthropic_messages`
- /v1/responses (and /render)                        `render_responses`
- /v1/completions (and /render)                      each text prompt in the §8.2 wrapper

The result is returned as token ids (`Ds4Tokenizer`, the engine's tokenization), which vLLM uses
as they are. vLLM may also render conversations of its own while handling a request (the
Anthropic route's one-time thinking probe, the Responses built-in tool loop); the body is used
only when it `describes` the messages vLLM passes. Without a raw body (offline `LLM.chat`, the
batch route, those extra renderings) the parsed messages are rendered by the same rules; tool
schemas are then compact JSON of what vLLM parsed, which matches the engine only if the client
sent compact JSON.
Offline `LLM.generate` text is tokenized as is (no wrapper): that API takes raw model input.

`ctx_size` (which decides whether max reasoning effort injects its prefix) is vLLM's
`max_model_len`, the engine's `-c`. The renderer owns the API server's `ServingState`
(`ds4_vllm.serving.state`): exact replay of sampled tool calls comes from its tool memory, and
the ids of a prompt that extends a known state's text are that state's exact ids plus the rest
tokenized (its text reuse).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.exceptions import VLLMValidationError
from vllm.renderers.base import BaseRenderer
from vllm.utils.async_utils import make_async

from ds4_vllm.chat.anthropic_request import render_anthropic_messages
from ds4_vllm.chat.chat_request import render_chat_completion
from ds4_vllm.chat.completion_request import render_completion
from ds4_vllm.chat.fields import RenderError
from ds4_vllm.chat.json_text import JsonTextError, parse_json
from ds4_vllm.chat.responses_request import render_responses
from ds4_vllm.chat.template import RenderedPrompt, completion_prompt_text
from ds4_vllm.chat.thinking import is_thinking_alias

from .request_body import RawRequest, Route
from .request_checks import check_tool_history
from .request_context import current_request, note_prompt
from .state import ServingState, register_for_tokenizer
from .tokenizer import Ds4HfTokenizer

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.renderers.chat_utils import ChatCompletionMessageParam, ConversationMessage
    from vllm.renderers.inputs import DictPrompt
    from vllm.renderers.params import ChatParams

logger = logging.getLogger(__name__)

_RENDERERS: dict[Route, Callable[..., RenderedPrompt]] = {
    Route.CHAT: render_chat_completion,
    Route.ANTHROPIC: render_anthropic_messages,
    Route.RESPONSES: render_responses,
}


def vllm_thinking_switch(body: Mapping, chat_template_kwargs: Mapping) -> bool | None:
    """vLLM's own thinking switch (`chat_template_kwargs` thinking / enable_thinking), if set.

    vLLM derives `enable_thinking` from `reasoning_effort` by itself; that copy is ignored, as the
    engine reads `reasoning_effort` directly (and lets `model` aliases decide when it is alone).
    """
    own = body.get("chat_template_kwargs")
    own = own if isinstance(own, Mapping) else {}
    for key in ("thinking", "enable_thinking"):
        value = chat_template_kwargs.get(key)
        derived = key == "enable_thinking" and key not in own and body.get("reasoning_effort") is not None
        if isinstance(value, bool) and not derived:
            return value
    return None


#: `--default-chat-template-kwargs '{"ds4_messages_thinking": false}'`: on /v1/messages, a body
#: without `thinking` renders without thinking (Anthropic's meaning of the absent field) instead of
#: the engine's default (on). A `deepseek-chat`/`deepseek-reasoner` model name still decides.
MESSAGES_THINKING_DEFAULT = "ds4_messages_thinking"


def route_thinking_switch(route: Route, body: Mapping, chat_template_kwargs: Mapping) -> bool | None:
    """The `vllm_switch` a route's rendering gets (`ds4_vllm.chat.thinking`, step 3).

    Anthropic requests get none from vLLM's kwargs: vLLM derives that switch from their own
    `thinking` and `output_config.effort`, which the engine reads with other meanings (an effort
    is no switch). Only the server's `MESSAGES_THINKING_DEFAULT` applies to them, and only to a
    body without `thinking` whose model is not one of the engine's thinking aliases.
    """
    if route is Route.ANTHROPIC:
        default = chat_template_kwargs.get(MESSAGES_THINKING_DEFAULT)
        model = body.get("model")
        if isinstance(default, bool) and "thinking" not in body and not is_thinking_alias(model):
            return default
        return None
    if route not in (Route.CHAT, Route.RESPONSES):
        return None
    return vllm_thinking_switch(body, chat_template_kwargs)


def fallback_chat_body(messages: Sequence[Any], params: ChatParams) -> dict[str, Any]:
    """A chat-completions body from what vLLM parsed (used when no raw body is available)."""
    kwargs = params.chat_template_kwargs or {}
    body: dict[str, Any] = {"messages": list(messages)}
    if kwargs.get("tools"):
        body["tools"] = kwargs["tools"]
    if kwargs.get("reasoning_effort") is not None:
        body["reasoning_effort"] = kwargs["reasoning_effort"]
    return body


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)
        )
    return ""


def describes(rendered: RenderedPrompt, messages: Sequence[Any]) -> bool:
    """Whether a rendering of the raw body is the conversation vLLM asked to render.

    vLLM converts each API to chat messages its own way, so the check is loose but enough to
    tell the request's conversation from others rendered in its context: the text of vLLM's
    last message must occur in the last non-system message the engine's parser found.
    """
    last = messages[-1] if messages else None
    text = _text_of(last.get("content")) if isinstance(last, Mapping) else ""
    if not text:
        return True
    ours = [m for m in rendered.messages if m.role not in ("system", "developer")]
    if not ours:
        return False
    m = ours[-1]
    return text in m.content + m.reasoning + "".join(c.arguments for c in m.tool_calls)


def _conversation(rendered: RenderedPrompt) -> list[ConversationMessage]:
    out: list[ConversationMessage] = []
    for m in rendered.messages:
        message: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning:
            message["reasoning"] = m.reasoning
        out.append(message)  # type: ignore[arg-type]
    return out


class Ds4Renderer(BaseRenderer[Ds4HfTokenizer]):
    """Renders chat, Anthropic, Responses and completion requests as the ds4 engine does."""

    def __init__(self, config: VllmConfig, tokenizer: Ds4HfTokenizer | None) -> None:
        super().__init__(config, tokenizer)
        self.ctx_size = config.model_config.max_model_len
        self.serving = ServingState.from_config(config, tokenizer.ds4 if tokenizer is not None else None)
        if tokenizer is not None:
            register_for_tokenizer(tokenizer, self.serving)  # the tool parser's way to it
        self._render_async = make_async(self.render_request, executor=self._executor)
        self._warned_no_body = False

    # -- text -------------------------------------------------------------------------------------

    def encode_prompt(self, text: str) -> list[int]:
        """Token ids of a rendered prompt as the engine builds them: the exact ids of the longest
        known state whose text begins it, then the tokenization of the rest (text-keyed reuse)."""
        reuse = self.serving.text_reuse
        return self.get_tokenizer().ds4.encode(text) if reuse is None else reuse.encode(text)

    def render_request(
        self,
        raw: RawRequest | None,
        messages: Sequence[Any],
        params: ChatParams,
    ) -> RenderedPrompt:
        """The engine's prompt for one chat-like request: from the raw body when there is one."""
        kwargs = params.chat_template_kwargs or {}
        try:
            if raw is not None and raw.route in _RENDERERS:
                body = self._parse_body(raw)
                check_tool_history(raw.route, body)
                switch = route_thinking_switch(raw.route, body, kwargs)
                rendered = _RENDERERS[raw.route](
                    body, ctx_size=self.ctx_size, replay=self.serving.replay, vllm_switch=switch
                )
                if describes(rendered, messages):
                    return rendered
            if raw is None and not self._warned_no_body:
                self._warned_no_body = True
                logger.info(
                    "ds4 renderer: rendering vLLM's parsed messages (no raw HTTP body: offline use, or "
                    "the server runs without --middleware ds4_vllm.serving.middleware.Ds4Middleware); "
                    "tool schemas are rendered as compact JSON"
                )
            body = fallback_chat_body(messages, params)
            switch = route_thinking_switch(Route.CHAT, body, kwargs)
            return render_chat_completion(
                body, ctx_size=self.ctx_size, replay=self.serving.replay, vllm_switch=switch
            )
        except RenderError as exc:
            raise VLLMValidationError(str(exc)) from None

    @staticmethod
    def _parse_body(raw: RawRequest) -> Mapping:
        try:
            body = parse_json(raw.body)
        except JsonTextError as exc:
            raise RenderError(f"request body: {exc}") from None
        if not isinstance(body, Mapping):
            raise RenderError("request body: expected a JSON object")
        return body

    def _prompt(self, rendered: RenderedPrompt) -> tuple[list[ConversationMessage], DictPrompt]:
        note_prompt(rendered.text)
        ids = self.encode_prompt(rendered.text)
        return _conversation(rendered), {"prompt_token_ids": ids, "prompt": rendered.text}  # type: ignore[return-value]

    # -- chat-like routes -------------------------------------------------------------------------

    def render_messages(
        self,
        messages: list[ChatCompletionMessageParam],
        params: ChatParams,
    ) -> tuple[list[ConversationMessage], DictPrompt]:
        return self._prompt(self.render_request(current_request().raw, messages, params))

    async def render_messages_async(
        self,
        messages: list[ChatCompletionMessageParam],
        params: ChatParams,
    ) -> tuple[list[ConversationMessage], DictPrompt]:
        # The context variable is read here: the executor's threads do not inherit it.
        rendered = await self._render_async(current_request().raw, messages, params)
        return self._prompt(rendered)

    # -- /v1/completions (§8.2) -------------------------------------------------------------------

    def completion_wrapper(self, prompt: DictPrompt | bytes) -> DictPrompt | bytes:
        """On /v1/completions a text prompt becomes the engine's fixed chat wrapper around it.

        Token-id prompts and embeddings are used as given. A list of text prompts renders each
        one (the engine itself answers only the first).
        """
        raw = current_request().raw
        if raw is None or raw.route is not Route.COMPLETION or not isinstance(prompt, dict):
            return prompt
        text = prompt.get("prompt")
        if not isinstance(text, str) or "prompt_token_ids" in prompt or "prompt_embeds" in prompt:
            return prompt
        try:
            think_mode = render_completion(self._parse_body(raw), ctx_size=self.ctx_size).think_mode
        except RenderError as exc:
            raise VLLMValidationError(str(exc)) from None
        wrapped = completion_prompt_text(text, think_mode)
        note_prompt(wrapped)
        return {**prompt, "prompt": wrapped, "prompt_token_ids": self.encode_prompt(wrapped)}  # type: ignore[return-value]

    def render_prompt(self, prompt: DictPrompt | bytes) -> DictPrompt:
        return super().render_prompt(self.completion_wrapper(prompt))

    async def _render_prompt_async(self, prompt: DictPrompt | bytes) -> DictPrompt:
        return await super()._render_prompt_async(self.completion_wrapper(prompt))

    def render_completion_suffix(self, prompt: str, suffix: str) -> str | None:
        return None  # the engine has no fill-in-the-middle rendering
