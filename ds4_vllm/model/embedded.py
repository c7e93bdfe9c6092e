"""The embedded model names (`ds4`, `ds4-tiny-q2`, `ds4-tiny-q4`) and how engine arguments resolve them.

`ds4` is the tiny default model directory (`default_model`), the two others are its shape as ds4
GGUF files (`tiny_gguf`); each is written on first use. Importing this module is cheap (no torch,
no vLLM, no gguf): the `vllm serve` command line is judged with these names before vLLM loads.
"""

from __future__ import annotations

import os
from typing import Any

DEFAULT_MODEL_NAME = "ds4"
#: Embedded ds4-layout GGUF models (q2 and q4 routed experts), generated on first use.
EMBEDDED_GGUF_MODELS = ("ds4-tiny-q2", "ds4-tiny-q4")
#: KV cache of an embedded model when nothing sizes it (see `resolve_default_model`).
DEFAULT_MODEL_KV_CACHE_BYTES = 2 << 30


def embedded_model_path(name: Any) -> str | None:
    """The local file or directory of an embedded model name (written on first use), else None."""
    if name == DEFAULT_MODEL_NAME:
        from ds4_vllm.model.default_model import default_model_dir

        return str(default_model_dir())
    if name in EMBEDDED_GGUF_MODELS:
        from ds4_vllm.model.tiny_gguf import tiny_gguf_file

        return str(tiny_gguf_file(name))
    return None


def embedded_name_of(path: Any) -> str | None:
    """The embedded model a resolved path belongs to (HF_HUB_OFFLINE may have mapped the name already)."""
    from ds4_vllm.model.default_model import default_model_path
    from ds4_vllm.model.tiny_gguf import tiny_gguf_path

    candidates = {str(default_model_path()): DEFAULT_MODEL_NAME}
    candidates.update({str(tiny_gguf_path(n)): n for n in EMBEDDED_GGUF_MODELS})
    return candidates.get(str(path))


def resolve_default_model(engine_args: Any) -> None:
    """Point EngineArgs at an embedded model when named (`ds4`, `ds4-tiny-q2`, `ds4-tiny-q4`).

    Also selects the GGUF config format, loader and embedded tokenizer for a GGUF model file.
    """
    from ds4_vllm.model.gguf_serving import prepare_gguf_engine_args

    for field in ("model", "tokenizer"):
        path = embedded_model_path(getattr(engine_args, field))
        if path is not None:
            setattr(engine_args, field, path)
    prepare_gguf_engine_args(engine_args)
    name = embedded_name_of(engine_args.model)
    if name is None:
        return
    # Clients keep calling it by its name.
    if engine_args.served_model_name is None:
        engine_args.served_model_name = name
    # The tiny models need little KV memory. Without a size, vLLM's CPU backend reserves 92% of
    # the machine's memory and refuses to start when that much is not free.
    if engine_args.kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        engine_args.kv_cache_memory_bytes = DEFAULT_MODEL_KV_CACHE_BYTES
