"""Exact replay in the API server: the process's tool memory and what each request tells the connector.

Three parts of one request meet here:

1. Rendering: `ToolReplay` is the renderer's `replay` callback (`ds4_vllm.chat.dsml.replayed_dsml`). It
   answers a tool-call id with the exact DSML sampled for it, reading the checkpoint directory's
   KTM trailers again once per request when an id is unknown (another server may have made it).
2. Before the request goes to the engine (`tool_transfer_params`, called from the tool parser's
   `adjust_request`), two entries go into the request's `kv_transfer_params`, the per-request
   channel to the ds4disk connector in the engine-core process:
   - `ds4_tool_ids`: a fresh secret seed, from which both sides derive the ids of the calls this
     request will sample (`tool_call_id`), so the checkpoint saved when the request finishes
     already maps them, before the client has seen them;
   - `ds4_tool_map`: `[id, dsml]` for every id of the request's history the memory knows, so
     every checkpoint whose text holds those blocks carries them in its KTM trailer.
   Client-sent values of these keys are replaced: a client cannot plant ids.
3. Parsing the answer: the tool parser derives the ids from the seed and remembers them here.

At start-up (`configure_tool_memory`) the memory takes the cap from `--tool-memory-max-ids` and
reads the trailers of the ds4disk checkpoint directory, so replay survives restarts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from ds4_vllm.store.tool_memory import (
    OPENAI_ID_PREFIX,
    ToolMemory,
    new_seed,
    random_tool_id,
    tool_call_id,
)

logger = logging.getLogger(__name__)

#: `kv_transfer_params` keys: the id seed of this request's own calls, and the history's map.
TOOL_IDS_KEY = "ds4_tool_ids"
TOOL_MAP_KEY = "ds4_tool_map"

_memory = ToolMemory()


def tool_memory() -> ToolMemory:
    """The memory of this API-server process."""
    return _memory


def set_tool_memory(memory: ToolMemory) -> ToolMemory:
    """Replace the process's memory (start-up and tests)."""
    global _memory
    _memory = memory
    return memory


def configure_tool_memory(vllm_config: Any) -> ToolMemory:
    """Size the memory from the ds4disk settings and load the checkpoint directory's trailers.

    Without the ds4disk connector replay still works within this process (default cap, no files).
    """
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is None or kv.kv_connector != "ds4disk":
        return set_tool_memory(ToolMemory())
    from ds4_vllm.connector.connector import store_options

    options, _ = store_options(vllm_config)
    directory = options.directory if options.is_local else None
    if directory is None:
        logger.info(
            "tool memory: %s is not a local directory; ids are not reloaded at start-up", options.directory
        )
    from ds4_vllm.store.options import local_path

    memory = ToolMemory(
        options.tool_memory_max_ids, directory=local_path(directory) if directory is not None else None
    )
    loaded = memory.load_directory()
    logger.info("tool memory: %d tool-call ids loaded from %s (cap %d)", loaded, directory, memory.max_ids)
    return set_tool_memory(memory)


class ToolReplay:
    """The renderer's `replay(tool_call_id)`: the remembered DSML of an exact id, else None.

    A miss first reads the checkpoint trailers written since the last read (`ToolMemory.restore`),
    so ids handed out by another server sharing the directory replay here too.
    """

    def __init__(self, memory: ToolMemory | None = None) -> None:
        self.memory = memory

    def __call__(self, tool_call_id: str) -> str | None:
        memory = self.memory if self.memory is not None else tool_memory()
        block = memory.lookup(tool_call_id)
        if block is None and memory.restore([tool_call_id]):
            block = memory.lookup(tool_call_id)
        return block


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


def tool_transfer_params(request: Any, memory: ToolMemory | None = None) -> dict[str, Any]:
    """The two `kv_transfer_params` entries of a request (see the module docstring)."""
    memory = memory if memory is not None else tool_memory()
    ids = history_tool_ids(request)
    memory.restore(ids)
    known = [[tool_id, block] for tool_id in ids if (block := memory.peek(tool_id)) is not None]
    return {TOOL_IDS_KEY: {"seed": new_seed(), "prefix": OPENAI_ID_PREFIX}, TOOL_MAP_KEY: known}


def attach_tool_transfer_params(request: Any, memory: ToolMemory | None = None) -> None:
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


def remember_calls(tool_ids: Iterable[str], dsml: str, memory: ToolMemory | None = None) -> None:
    (memory if memory is not None else tool_memory()).remember_calls(tool_ids, dsml)
