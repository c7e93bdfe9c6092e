"""vLLM API-server glue for ds4, above `ds4_vllm.connector` (which runs in the engine core).

- start-up: `startup` (tokenizer mode `ds4`, the `vllm serve` flags a ds4 model gets);
- rendering: `tokenizer` (the ds4 engine's tokenization), `renderer` (its prompt text for every
  route), `request_body` (the raw request bytes the renderer needs);
- output parsers and exact replay: `tool_parser`, `reasoning_parser`, `parsers`, `tool_replay`;
- cache usage on every response: `usage` (pure dict rewriting), `request_outputs` (what the
  engine reported for the requests of one HTTP request), `middleware` (rewrites usage in JSON
  and SSE responses), `usage_counters` (cumulative hit/miss counters next to the checkpoints);
- `kv_cache_route`: the `GET /v1/kv_cache` endpoint plugin.
"""
