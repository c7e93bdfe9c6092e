"""`GET /v1/kv_cache`: the disk cache's size and the cumulative cache usage, as a vLLM endpoint plugin.

The API server does not own the checkpoint store (the engine core's ds4disk connector does),
so the route reads the directory itself: an index of the `.kv` headers (the same validity
rules as the store's, re-read only for changed files) for `entries` and `bytes_used`, and
the counters file that the usage middleware updates (`ds4_vllm.serving.usage_counters`) for
the tokens. Answer (all integers but `hit_rate` and `directory`)::

    {"object": "kv_cache", "disk_cache": true, "directory": "/path", "entries": 3,
     "bytes_used": 123, "budget_bytes": 4294967296, "requests": 10, "prompt_tokens": 5000,
     "prompt_cache_hit_tokens": 4000, "prompt_cache_miss_tokens": 1000,
     "prompt_cache_disk_tokens": 2048, "hit_rate": 0.8, "counters_persistent": true}

`hit_rate` = hit / (hit + miss), null before the first request. Without ds4disk the route
still answers: `disk_cache` false, no directory, 0 entries/bytes/budget, and counters of this
process since it started (`counters_persistent` false), covering vLLM's in-memory prefix cache.

Loading: vLLM loads `vllm.endpoint_plugins` entry points only when named in `VLLM_PLUGINS`.
This plugin's entry point is named `ds4`, like the general plugin, so `VLLM_PLUGINS=ds4` (plus
any other plugins) loads both; with `VLLM_PLUGINS` unset, `ds4_vllm.vllm_compat` loads it
without further flags.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from argparse import Namespace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ds4_vllm.serving.usage import CacheUsage
from ds4_vllm.serving.usage_counters import UsageCounters

logger = logging.getLogger(__name__)

ROUTE = "/v1/kv_cache"
PLUGIN_NAME = "ds4"
_STATE_ATTR = "ds4_cache_state"


@dataclasses.dataclass
class DiskCacheView:
    """A read-only view of the ds4disk directory from the API server process."""

    directory: str
    budget_bytes: int
    index: Any  # ds4_vllm.kvc.CheckpointIndex or its fsspec twin

    def size(self) -> tuple[int, int]:
        """(valid checkpoint files, their bytes) after re-reading what changed."""
        self.index.refresh()
        return len(self.index), self.index.total_bytes


class ServingCacheState:
    """Per API server process: the usage counters and, with ds4disk, the directory view."""

    def __init__(self, disk: DiskCacheView | None, counters: UsageCounters) -> None:
        self.disk = disk
        self.counters = counters
        self._lock = threading.Lock()  # the route runs in a worker thread

    def record_usage(self, cache: CacheUsage) -> None:
        self.counters.add(cache)

    def report(self) -> dict[str, Any]:
        with self._lock:
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


def is_ds4_model(vllm_config: Any) -> bool:
    from ds4_vllm.model.config import DS4_ARCHITECTURE

    architectures = getattr(getattr(vllm_config, "model_config", None), "architectures", None) or ()
    return DS4_ARCHITECTURE in architectures


def build_cache_state(vllm_config: Any) -> ServingCacheState:
    """The state for a served ds4 model: ds4disk's directory and budget, as the connector derives them."""
    kv_config = getattr(vllm_config, "kv_transfer_config", None)
    if kv_config is None or kv_config.kv_connector != "ds4disk":
        return ServingCacheState(None, UsageCounters(None))
    from ds4_vllm.connector.connector import store_options
    from ds4_vllm.kvc import CheckpointIndex
    from ds4_vllm.store.fs import open_fs
    from ds4_vllm.store.options import local_path

    options, _ = store_options(vllm_config)
    if options.is_local:
        directory = local_path(options.directory)
        index = CheckpointIndex(directory, keep_text=False)
        counters = UsageCounters(directory)
    else:  # fsspec URL: the index lists it remotely; no shared lock, so counters stay in memory
        index = open_fs(options.directory).new_index()
        counters = UsageCounters(None)
    view = DiskCacheView(str(options.directory), options.budget_bytes, index)
    return ServingCacheState(view, counters)


def serving_cache_state(app_state: Any) -> ServingCacheState | None:
    """The app's state, built on first use; None when the served model is not a ds4 model."""
    state = getattr(app_state, _STATE_ATTR, None)
    if state is not None:
        return state
    vllm_config = getattr(app_state, "vllm_config", None)
    if vllm_config is None or not is_ds4_model(vllm_config):
        return None
    state = build_cache_state(vllm_config)
    setattr(app_state, _STATE_ATTR, state)
    return state


def kv_cache_endpoint(request: Request) -> JSONResponse:
    """`GET /v1/kv_cache` (a sync route: FastAPI runs it in a worker thread, off the event loop)."""
    state = serving_cache_state(request.app.state)
    if state is None:
        return JSONResponse(
            {"error": {"message": f"{ROUTE} reports the ds4 cache; the served model is not a ds4 model"}},
            status_code=404,
        )
    return JSONResponse(state.report())


class Ds4KvCacheEndpoint:
    """The `vllm.endpoint_plugins` entry point: adds `GET /v1/kv_cache`."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        app.add_api_route(ROUTE, kv_cache_endpoint, methods=["GET"], summary="ds4 KV cache size and usage")

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        # Built now, not on the first request: deriving the directory reads the model's files.
        serving_cache_state(state)
