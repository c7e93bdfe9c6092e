"""Ray Serve's prefix-aware router for ds4 requests, prompts given as token ids included.

Imported by the ingress replicas of `ds4-vllm ray-serve` (by class, through `LLMConfig`).
"""

from __future__ import annotations

from typing import Any

from ray.serve.llm.request_router import PrefixCacheAffinityRouter

#: A token id becomes one character past Latin-1, so token-id prompts share no key with text.
TOKEN_CHAR_BASE = 0x100


def token_ids_key(prompt: Any) -> str | None:
    """One character per token when `prompt` is a non-empty list of token ids, else None."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt):
        return "".join(chr(TOKEN_CHAR_BASE + t) for t in prompt)
    return None


class Ds4PrefixRouter(PrefixCacheAffinityRouter):
    """`PrefixCacheAffinityRouter` that keys token-id prompts by their ids.

    Ray 2.60's router reads `.prompt` / `.messages` as text. A completion whose prompt is a list
    of token ids gives "", and the match rate then divides by zero inside the router: the
    request is never routed and the client hangs. Here token-id prompts are keyed one character
    per token, and a request with no text at all gets Ray's default choice (two random replicas,
    the shorter queue).
    """

    def _normalize_prompt_to_string(self, prompt: Any) -> str:
        key = token_ids_key(prompt)
        return key if key is not None else super()._normalize_prompt_to_string(prompt)

    def _extract_text_from_request(self, pending_request: Any) -> str | None:
        return super()._extract_text_from_request(pending_request) or None
