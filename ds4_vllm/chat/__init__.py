"""Prompt text exactly as the ds4 engine renders it, and its tokenization, without vLLM
(shared/specs/kvc-format.md §8-§9).

The rendered text is the disk-cache key: one byte of difference and an engine checkpoint is never
found. So every rule is the engine's, including its quirks (raw tool-schema bytes, DSML escaping,
when old reasoning is kept). One module per job:

- request decoding, one module per API: `chat_request.render_chat_completion` (/v1/chat/completions),
  `anthropic_request.render_anthropic_messages` (/v1/messages), `responses_request.render_responses`
  (/v1/responses), `completion_request.render_completion` (/v1/completions);
- `thinking`: the think mode of a request (one resolver, the precedence stated once);
- `tool_schemas`: the tools block; `dsml`: tool-call blocks, written and parsed;
- `template`: the §8.1/§8.2 templates over converted `messages.ChatMessage`s (`render_messages`);
- `fields`, `json_text`: reading request JSON as the engine does; `tokenizer`: text -> token ids.

Each request argument is either the raw request body (bytes/str: best, every raw byte is kept) or
the parsed JSON as plain Python values. With parsed values, pass `tools_json` (the raw bytes of the
request's `tools` array) to keep the client's schema formatting; otherwise compact JSON is assumed.
`replay(tool_call_id)` may return the exact DSML block the model sampled for that call (the
engine's tool memory and KTM trailers): an assistant turn whose call ids all map to one same block
is rendered with those bytes verbatim, others canonically.
"""
