"""vLLM API-server glue for ds4: cache usage on every response and `GET /v1/kv_cache`.

Runs in the API server process, above `ds4_vllm.connector` (which runs in the engine core):

- `usage`: the usage fields of each route (pure dict rewriting, no vLLM);
- `request_outputs`: what the engine reported for the requests of one HTTP request;
- `middleware`: the ASGI middleware that rewrites usage in JSON and SSE responses;
- `usage_counters`: the cumulative hit/miss counters, persisted next to the checkpoints;
- `kv_cache_route`: the `GET /v1/kv_cache` endpoint plugin.
"""
