"""What one API server keeps across requests: one `ServingState`, owned by its ds4 renderer.

- `tool_memory`: tool-call id -> the exact DSML block sampled for it (exact replay,
  `ds4_vllm.serving.tool_replay`), loaded from the ds4disk directory's KTM trailers at start-up;
- `text_reuse`: known token sequences by text (`ds4_vllm.store.text_reuse`): this server's
  finished requests, and the directory's checkpoint files;
- `counters`: the cumulative cache usage of its responses (`ds4_vllm.serving.usage_counters`),
  and `disk`, a read-only view of the ds4disk directory, for `GET /v1/kv_cache`.

vLLM builds one renderer per engine client, i.e. per API server (and per offline `LLM`):
`Ds4Renderer.__init__` builds the state from the `VllmConfig` (`ServingState.from_config`, the
only place the API server reads the ds4disk settings). Each component reaches it through the
handle vLLM gives it, never through a module global:

- route handlers and middleware: the app's engine client (`serving_state_of_app`: vLLM's
  `app.state.engine_client`, whose `renderer` is the `Ds4Renderer`);
- the engine-output hook on `AsyncLLM.generate`: the engine client it wraps (`serving_state_of_engine`);
- the tool parser, which vLLM builds per request from the renderer's tokenizer only: that
  tokenizer (`serving_state_for_tokenizer`; the renderer registers its state under it).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Any

from ds4_vllm.serving.usage import CacheUsage
from ds4_vllm.serving.usage_counters import UsageCounters
from ds4_vllm.store.text_reuse import CheckpointPrefixes, TextReuse, TokenizerLike, TokenMemory
from ds4_vllm.store.tool_memory import ToolMemory

logger = logging.getLogger(__name__)

#: The connector whose directory the API server reads (checkpoints, trailers, counters).
DISK_CONNECTOR = "ds4disk"


@dataclasses.dataclass
class DiskCacheView:
    """A read-only view of the ds4disk directory from the API server process."""

    directory: str
    budget_bytes: int
    index: Any  # ds4_vllm.kvc.CheckpointIndex or its fsspec twin
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def size(self) -> tuple[int, int]:
        """(valid checkpoint files, their bytes) after re-reading what changed."""
        with self._lock:  # GET /v1/kv_cache runs in worker threads
            self.index.refresh()
            return len(self.index), self.index.total_bytes


class ServingState:
    """One API server's tool memory, text reuse and usage counters (see the module docstring)."""

    def __init__(
        self,
        *,
        tool_memory: ToolMemory | None = None,
        text_reuse: TextReuse | None = None,
        counters: UsageCounters | None = None,
        disk: DiskCacheView | None = None,
        with_connector: bool | None = None,
    ) -> None:
        #: Whether requests go to the ds4disk connector (default: when a disk view is given).
        self.with_connector = disk is not None if with_connector is None else with_connector
        self.tool_memory = tool_memory if tool_memory is not None else ToolMemory()
        self.text_reuse = text_reuse
        self.counters = counters if counters is not None else UsageCounters(None)
        self.disk = disk

    @classmethod
    def from_config(cls, vllm_config: Any, tokenizer: TokenizerLike | None) -> ServingState:
        """The state for a served ds4 model. With ds4disk the tool memory is sized by
        `--tool-memory-max-ids` and loaded from the directory's trailers, text reuse also reads
        its checkpoint files, and the counters live in it; without ds4disk all of them are this
        process's only (default cap, no files, in-memory counters)."""
        kv = getattr(vllm_config, "kv_transfer_config", None)
        if kv is None or kv.kv_connector != DISK_CONNECTOR:
            reuse = TextReuse(tokenizer, TokenMemory(tokenizer), None) if tokenizer is not None else None
            return cls(text_reuse=reuse)
        from ds4_vllm.connector.connector import store_options
        from ds4_vllm.kvc import CheckpointIndex
        from ds4_vllm.store.fs import open_fs
        from ds4_vllm.store.options import local_path

        options, _ = store_options(vllm_config)
        fs = open_fs(options.directory)
        memory = ToolMemory(options.tool_memory_max_ids, checkpoints=fs)
        loaded = memory.load_directory()
        logger.info("tool memory: %d tool-call ids loaded from %s (cap %d)", loaded, fs.url, memory.max_ids)
        if options.is_local:
            directory = local_path(options.directory)
            files = CheckpointPrefixes(directory, tokenizer) if tokenizer is not None else None
            index = CheckpointIndex(directory, keep_text=False)
            counters = UsageCounters(directory)
        else:  # fsspec URL: the index lists it remotely; no shared lock, so counters stay in memory
            logger.info(
                "%s is not a local directory: text reuse covers this process's turns only, usage "
                "counters are in memory",
                options.directory,
            )
            files = None
            index = fs.new_index()
            counters = UsageCounters(None)
        reuse = TextReuse(tokenizer, TokenMemory(tokenizer), files) if tokenizer is not None else None
        disk = DiskCacheView(str(options.directory), options.budget_bytes, index)
        return cls(tool_memory=memory, text_reuse=reuse, counters=counters, disk=disk)

    # -- what the components ask ------------------------------------------------------------------

    def replay(self, tool_call_id: str) -> str | None:
        """The renderer's `replay(tool_call_id)`: the remembered DSML of an exact id, else None.

        A miss first reads the checkpoint trailers written since the last read, so ids handed
        out by another server sharing the directory replay here too.
        """
        block = self.tool_memory.lookup(tool_call_id)
        if block is None and self.tool_memory.restore([tool_call_id]):
            block = self.tool_memory.lookup(tool_call_id)
        return block

    def attach_tool_transfer_params(self, request: Any) -> None:
        """Give a request, before it goes to the engine, what the ds4disk connector needs to map
        its tool calls (`ds4_vllm.serving.tool_replay.attach_tool_transfer_params`).

        Only with ds4disk: without a connector vLLM drops `kv_transfer_params` with a warning per
        request, and the serving side's random call ids replay from memory just as well."""
        if not self.with_connector:
            return
        from ds4_vllm.serving.tool_replay import attach_tool_transfer_params

        attach_tool_transfer_params(request, self.tool_memory)

    def remember_sequence(self, ids: list[int]) -> None:
        """A finished sequence's exact ids (prompt + output), for text-keyed reuse of the next turn."""
        if self.text_reuse is not None and ids:
            self.text_reuse.remember(ids)

    def record_usage(self, cache: CacheUsage) -> None:
        self.counters.add(cache)

    def kv_cache_report(self) -> dict[str, Any]:
        """The `GET /v1/kv_cache` answer (`ds4_vllm.serving.kv_cache_route`)."""
        entries, bytes_used = self.disk.size() if self.disk is not None else (0, 0)
        totals = self.counters.totals()
        return {
            "object": "kv_cache",
            "disk_cache": self.disk is not None,
            "directory": self.disk.directory if self.disk is not None else None,
            "entries": entries,
            "bytes_used": bytes_used,
            "budget_bytes": self.disk.budget_bytes if self.disk is not None else 0,
            "requests": totals.requests,
            "prompt_tokens": totals.prompt_tokens,
            "prompt_cache_hit_tokens": totals.hit_tokens,
            "prompt_cache_miss_tokens": totals.miss_tokens,
            "prompt_cache_disk_tokens": totals.disk_tokens,
            "hit_rate": totals.hit_rate,
            "counters_persistent": self.counters.persistent,
        }


# -- how the components reach it -------------------------------------------------------------------

_BY_TOKENIZER: weakref.WeakKeyDictionary[Any, ServingState] = weakref.WeakKeyDictionary()


def register_for_tokenizer(tokenizer: Any, state: ServingState) -> ServingState:
    """Make `state` the one parsers built from `tokenizer` use (the renderer does this for its own)."""
    _BY_TOKENIZER[tokenizer] = state
    return state


def serving_state_for_tokenizer(tokenizer: Any) -> ServingState:
    """The state of the renderer whose tokenizer this is; a process-local one for a tokenizer no
    renderer registered (parsers used on their own), kept for that tokenizer."""
    state = _BY_TOKENIZER.get(tokenizer)
    if state is None:
        state = register_for_tokenizer(tokenizer, ServingState())
    return state


def serving_state_of_engine(engine_client: Any) -> ServingState | None:
    """The state of an engine client's ds4 renderer; None for another renderer (not a ds4 model)."""
    state = getattr(getattr(engine_client, "renderer", None), "serving", None)
    return state if isinstance(state, ServingState) else None


def serving_state_of_app(app_state: Any) -> ServingState | None:
    """The state of the app's engine client (vLLM's `app.state.engine_client`)."""
    return serving_state_of_engine(getattr(app_state, "engine_client", None))
