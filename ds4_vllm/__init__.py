"""ds4-vllm: DeepSeek V4 Flash for vLLM, with ds4-compatible on-disk KV checkpoints.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml). vLLM calls it in every
process it starts (API server, engine core, workers), so it is idempotent and cheap: heavy
modules (the model, the connector) are registered by name and imported only when used.
It uses vLLM's public extension points (model registry, KV connector factory, config parsers);
what has no public hook is patched in `ds4_vllm.vllm_compat`, one module per vLLM release.
"""

from __future__ import annotations

import logging

__all__ = ["register"]

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
