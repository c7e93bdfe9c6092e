"""`GET /v1/kv_cache`: the disk cache's size and the cumulative cache usage, as a vLLM endpoint plugin.

The API server does not own the checkpoint store (the engine core's ds4disk connector does),
so the server's `ServingState` (`ds4_vllm.serving.state`) reads the directory itself: an index of
the `.kv` headers (the same validity rules as the store's, re-read only for changed files) for
`entries` and `bytes_used`, and the counters file that the usage middleware updates
(`ds4_vllm.serving.usage_counters`) for the tokens. Answer (all integers but `hit_rate` and
`directory`)::

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

from argparse import Namespace
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from ds4_vllm.serving.state import serving_state_of_app

ROUTE = "/v1/kv_cache"
PLUGIN_NAME = "ds4"


def kv_cache_endpoint(request: Request) -> JSONResponse:
    """`GET /v1/kv_cache` (a sync route: FastAPI runs it in a worker thread, off the event loop)."""
    state = serving_state_of_app(request.app.state)
    if state is None:
        return JSONResponse(
            {"error": {"message": f"{ROUTE} reports the ds4 cache; the served model is not a ds4 model"}},
            status_code=404,
        )
    return JSONResponse(state.kv_cache_report())


class Ds4KvCacheEndpoint:
    """The `vllm.endpoint_plugins` entry point: adds `GET /v1/kv_cache`."""

    name = PLUGIN_NAME
    required_tasks = ("generate",)

    def attach_router(self, app: Any) -> None:
        app.add_api_route(ROUTE, kv_cache_endpoint, methods=["GET"], summary="ds4 KV cache size and usage")

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        """Nothing to set up: the serving state exists with the engine client's ds4 renderer."""
