"""ds4-vllm: DeepSeek V4 Flash for vLLM, with ds4-compatible on-disk KV checkpoints.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml). vLLM calls it in every
process it starts (API server, engine core, workers), so it is idempotent and cheap: heavy
modules (the model, the connector) are registered by name and imported only when used.
It uses vLLM's public extension points (model registry, KV connector factory, config parsers);
what has no public hook is patched in `ds4_vllm.vllm_compat`, one module per vLLM release.
"""

from __future__ import annotations

import logging
import os
from typing import Any

__all__ = ["embedded_model_path", "register", "resolve_default_model"]

DEFAULT_MODEL_NAME = "ds4"
#: Embedded ds4-layout GGUF models (q2 and q4 routed experts), generated on first use.
EMBEDDED_GGUF_MODELS = ("ds4-tiny-q2", "ds4-tiny-q4")
DEFAULT_MODEL_KV_CACHE_BYTES = 2 << 30
MODEL_CLASS = "ds4_vllm.model.model:Ds4ForCausalLM"
CONNECTOR_NAME = "ds4disk"
CONNECTOR_MODULE = "ds4_vllm.connector.connector"
CONNECTOR_CLASS = "Ds4DiskConnector"

logger = logging.getLogger(__name__)
_registered = False


def register() -> None:
    """Register ds4 with transformers and vLLM; see the module docstring."""
    global _registered
    if _registered:
        return
    _registered = True

    from ds4_vllm import vllm_compat
    from ds4_vllm.model.config import register_auto_config
    from ds4_vllm.model.config_parser import register_config_format
    from ds4_vllm.model.gguf_serving import register_gguf_loader
    from ds4_vllm.serving.parsers import register_parsers
    from ds4_vllm.serving.startup import register_tokenizer_and_renderer

    register_auto_config()
    _register_model()
    _register_connector()
    register_config_format()
    register_gguf_loader()
    register_parsers()
    register_tokenizer_and_renderer()
    vllm_compat.apply()


def _register_model() -> None:
    from vllm import ModelRegistry

    from ds4_vllm.model.config import DS4_ARCHITECTURE

    if DS4_ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(DS4_ARCHITECTURE, MODEL_CLASS)


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:  # vLLM's answer when the name is already registered in this process
        logger.debug("KV connector %s was already registered", CONNECTOR_NAME)


def embedded_model_path(name: Any) -> str | None:
    """The local file or directory of an embedded model name (written on first use), else None."""
    if name == DEFAULT_MODEL_NAME:
        from ds4_vllm.model.default_model import default_model_dir

        return str(default_model_dir())
    if name in EMBEDDED_GGUF_MODELS:
        from ds4_vllm.model.tiny_gguf import tiny_gguf_file

        return str(tiny_gguf_file(name))
    return None


def _embedded_name_of(path: Any) -> str | None:
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
    name = _embedded_name_of(engine_args.model)
    if name is None:
        return
    # Clients keep calling it by its name.
    if engine_args.served_model_name is None:
        engine_args.served_model_name = name
    # The tiny models need little KV memory. Without a size, vLLM's CPU backend reserves 92% of
    # the machine's memory and refuses to start when that much is not free.
    if engine_args.kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        engine_args.kv_cache_memory_bytes = DEFAULT_MODEL_KV_CACHE_BYTES
