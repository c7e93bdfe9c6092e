"""Serving glue for the ds4 engine's exact prompts: tokenizer and renderer mode `ds4`, raw bodies.

- `tokenizer`: `Ds4HfTokenizer`, vLLM tokenizer mode `ds4` (the engine's tokenization).
- `renderer`: `Ds4Renderer`, vLLM renderer mode `ds4` (`ds4_vllm.chat.render` per API route).
- `request_body`: the ASGI middleware that hands the client's raw body to the renderer.
- `startup`: registration, the automatic tokenizer-mode choice and the `vllm serve` flags.

Layering: above `ds4_vllm.connector` (imports vLLM); uses `ds4_vllm.chat` and `ds4_vllm.model`.
Importing this package imports nothing else; vLLM loads the modules by name when it needs them.
"""
