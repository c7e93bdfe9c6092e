"""vLLM API-server glue for ds4, above `ds4_vllm.connector` (which runs in the engine core).

- start-up: `startup` (tokenizer mode `ds4`, the `vllm serve` flags a ds4 model gets);
- the server's state across requests: `state` (`ServingState`: tool memory, text reuse, usage
  counters, one per API server, owned by the renderer);
- one HTTP request: `request_context` (what the code vLLM runs inside it reads: the raw body,
  the engine-output recorder), `request_body` (the middleware that keeps the raw request bytes),
  `request_checks` (tool-call histories refused before rendering);
- rendering: `tokenizer` (the ds4 engine's tokenization), `renderer` (its prompt text for every
  route);
- output parsers and exact replay: `tool_parser`, `reasoning_parser`, `parsers`, `tool_replay`;
- cache usage on every response: `usage` (pure dict rewriting), `request_outputs` (what the
  engine reported for the requests of one HTTP request), `middleware` (rewrites usage in JSON
  and SSE responses), `usage_counters` (cumulative hit/miss counters next to the checkpoints);
- `kv_cache_route`: the `GET /v1/kv_cache` endpoint plugin.
"""
