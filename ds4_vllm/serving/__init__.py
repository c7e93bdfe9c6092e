"""vLLM API-server glue for ds4: tokenizer, renderer, output parsers and exact tool-call replay."""
