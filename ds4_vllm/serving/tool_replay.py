"""Exact replay in the API server: what each request tells the connector about tool-call ids.

The memory itself is the server's (`ServingState.tool_memory`, `ds4_vllm.serving.state`). Three
parts of one request meet it:

1. Rendering: `ServingState.replay` is the renderer's `replay` callback
   (`ds4_vllm.chat.dsml.replayed_dsml`). It answers a tool-call id with the exact DSML sampled for
   it, reading the checkpoint directory's KTM trailers again once per request when an id is
   unknown (another server may have made it).
2. Before the request goes to the engine (`attach_tool_transfer_params`, called from the tool
   parser's `adjust_request` through `ServingState.attach_tool_transfer_params`), two entries go
   into the request's `kv_transfer_params`, the per-request channel to the ds4disk connector in
   the engine-core process:
   - `ds4_tool_ids`: a fresh secret seed, from which both sides derive the ids of the calls this
     request will sample (`tool_call_id`), so the checkpoint saved when the request finishes
     already maps them, before the client has seen them;
   - `ds4_tool_map`: `[id, dsml]` for every id of the request's history the memory knows, so
     every checkpoint whose text holds those blocks carries them in its KTM trailer.
   Client-sent values of these keys are replaced: a client cannot plant ids.
3. Parsing the answer: the tool parser derives the ids from the seed (`call_ids_for`) and
   remembers them in the memory.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

from ds4_vllm.contracts import TOOL_IDS_KEY, TOOL_MAP_KEY
from ds4_vllm.store.tool_memory import (
    OPENAI_ID_PREFIX,
    ToolMemory,
    new_seed,
    random_tool_id,
    tool_call_id,
)

logger = logging.getLogger(__name__)


def history_tool_ids(request: Any) -> list[str]:
    """Every tool-call id a request's history mentions (chat `tool_calls[].id`, Anthropic
    `tool_use` ids after vLLM's conversion, Responses `call_id`s), in order, without repeats."""
    seen: dict[str, None] = {}
    for source in ("messages", "input"):
        for value in _ids_in(getattr(request, source, None)):
            seen.setdefault(value, None)
    return list(seen)


def _ids_in(value: Any, depth: int = 0) -> Iterator[str]:
    if depth > 8 or value is None or isinstance(value, str | bytes | int | float | bool):
        return
    if hasattr(value, "model_dump") and not isinstance(value, Mapping):
        value = value.model_dump()
    if isinstance(value, Mapping):
        for key in ("id", "call_id", "tool_use_id", "tool_call_id"):
            found = value.get(key)
            if isinstance(found, str) and found:
                yield found
        for key, item in value.items():
            if key in ("tool_calls", "content", "input") or isinstance(item, list):
                yield from _ids_in(item, depth + 1)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _ids_in(item, depth + 1)


def tool_transfer_params(request: Any, memory: ToolMemory) -> dict[str, Any]:
    """The two `kv_transfer_params` entries of a request (see the module docstring)."""
    ids = history_tool_ids(request)
    memory.restore(ids)
    known = [[tool_id, block] for tool_id in ids if (block := memory.peek(tool_id)) is not None]
    return {TOOL_IDS_KEY: {"seed": new_seed(), "prefix": OPENAI_ID_PREFIX}, TOOL_MAP_KEY: known}


def attach_tool_transfer_params(request: Any, memory: ToolMemory) -> None:
    """Put `tool_transfer_params` into `request.kv_transfer_params`, keeping other keys."""
    params = dict(getattr(request, "kv_transfer_params", None) or {})
    params.update(tool_transfer_params(request, memory))
    request.kv_transfer_params = params


def call_ids_for(request: Any, dsml: str, count: int) -> list[str]:
    """The ids of a sampled block's calls: derived from the request's seed (as the connector
    derives them), or random when the request carries none."""
    params = getattr(request, "kv_transfer_params", None) or {}
    spec = params.get(TOOL_IDS_KEY) if isinstance(params, Mapping) else None
    seed = spec.get("seed") if isinstance(spec, Mapping) else None
    prefix = spec.get("prefix", OPENAI_ID_PREFIX) if isinstance(spec, Mapping) else OPENAI_ID_PREFIX
    if not isinstance(seed, str) or not _is_seed(seed):
        return [random_tool_id(prefix) for _ in range(count)]
    return [tool_call_id(seed, dsml, i, prefix) for i in range(count)]


def _is_seed(seed: str) -> bool:
    try:
        return len(bytes.fromhex(seed)) == 16
    except ValueError:
        return False
