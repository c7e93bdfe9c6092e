"""ds4-vllm: DeepSeek V4 Flash for vLLM, with ds4-compatible on-disk KV checkpoints.

`register()` is the `vllm.general_plugins` entry point (pyproject.toml). vLLM calls it in every
process it starts (API server, engine core, workers), so it is idempotent and cheap: heavy
modules (the model, the connector) are registered by name and imported only when used.
"""

from __future__ import annotations

import functools
import logging
import multiprocessing
import os
import sys
from typing import Any

__all__ = ["register"]

DEFAULT_MODEL_NAME = "ds4"
DEFAULT_MODEL_KV_CACHE_BYTES = 2 << 30
MODEL_ARCH = "Ds4ForCausalLM"
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

    from ds4_vllm.model.config import register_auto_config

    register_auto_config()
    _register_model()
    _register_connector()
    _patch_default_model_name()
    _patch_hf_config_conversion()
    _rewrite_serve_argv()


def _register_model() -> None:
    from vllm import ModelRegistry

    if MODEL_ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(MODEL_ARCH, MODEL_CLASS)


def _register_connector() -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    # No public "is registered" check; registering twice raises ValueError.
    if CONNECTOR_NAME not in KVConnectorFactory._registry:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)


def resolve_default_model(engine_args: Any) -> None:
    """Point EngineArgs at the embedded default model when its model (or tokenizer) is `ds4`."""
    from ds4_vllm.model.default_model import default_model_dir, default_model_path

    if DEFAULT_MODEL_NAME in (engine_args.model, engine_args.tokenizer):
        path = str(default_model_dir())
        if engine_args.model == DEFAULT_MODEL_NAME:
            engine_args.model = path
        if engine_args.tokenizer == DEFAULT_MODEL_NAME:
            engine_args.tokenizer = path
    if engine_args.model != str(default_model_path()):
        return
    # Clients keep calling it "ds4" (also when HF_HUB_OFFLINE already mapped the name to the path).
    if engine_args.served_model_name is None:
        engine_args.served_model_name = DEFAULT_MODEL_NAME
    # The tiny model needs little KV memory. Without a size, vLLM's CPU backend reserves 92% of
    # the machine's memory and refuses to start when that much is not free.
    if engine_args.kv_cache_memory_bytes is None and "VLLM_CPU_KVCACHE_SPACE" not in os.environ:
        engine_args.kv_cache_memory_bytes = DEFAULT_MODEL_KV_CACHE_BYTES


def _patch_default_model_name() -> None:
    """Make `LLM(model="ds4")` (and any EngineArgs(model="ds4")) use the default model dir.

    vLLM resolves the model name in two places we hook, both after this plugin has run:
    - `EngineArgs.__post_init__` loads the plugins and then, with HF_HUB_OFFLINE=1, maps the
      name through `arg_utils.get_model_path` (a hub snapshot lookup that would fail for "ds4");
    - `EngineArgs.create_engine_config` reads the config (speculator check, then ModelConfig).
    The first EngineArgs instance is already inside `__post_init__` when this runs, so patching
    `__post_init__` itself would miss it; these two hooks see every instance.
    """
    from vllm.engine import arg_utils

    if getattr(arg_utils.EngineArgs.create_engine_config, "_ds4_patched", False):
        return
    original_create = arg_utils.EngineArgs.create_engine_config
    original_get_model_path = arg_utils.get_model_path

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        resolve_default_model(self)
        return original_create(self, *args, **kwargs)

    @functools.wraps(original_get_model_path)
    def get_model_path(model: Any, revision: str | None = None) -> Any:
        if model == DEFAULT_MODEL_NAME:
            from ds4_vllm.model.default_model import default_model_dir

            return str(default_model_dir())
        return original_get_model_path(model, revision)

    create_engine_config._ds4_patched = True  # type: ignore[attr-defined]
    arg_utils.EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]
    arg_utils.get_model_path = get_model_path


def _patch_hf_config_conversion() -> None:
    """Load a `model_type: deepseek_v4` checkpoint served as Ds4ForCausalLM as a Ds4Config.

    A directory saved by transformers' DeepseekV4ForCausalLM says `model_type: deepseek_v4`.
    For that type vLLM loads its own DeepseekV4Config (which rejects transformers' saved
    `mlp_layer_types`) and keys DeepSeek-V4 special cases on the model type (MLA, block size
    256 and no prefix caching on CPU, its arch-config convertor, tokenizer mode). When
    `--hf-overrides '{"architectures": ["Ds4ForCausalLM"]}'` asks for our model, we parse
    config.json with Ds4Config instead (model_type "ds4"), so that single override is enough.
    vLLM applies the override to the result afterwards, as for any config.
    """
    from vllm.transformers_utils import config as hf_config_utils

    parser = hf_config_utils.HFConfigParser
    if getattr(parser.parse, "_ds4_patched", False):
        return
    original = parser.parse

    @functools.wraps(original)
    def parse(
        self: Any,
        model: Any,
        trust_remote_code: bool,
        revision: str | None = None,
        code_revision: str | None = None,
        **kwargs: Any,
    ) -> Any:
        overrides = kwargs.get("hf_overrides")
        if isinstance(overrides, dict) and MODEL_ARCH in (overrides.get("architectures") or []):
            return _parse_as_ds4(model, revision, code_revision, kwargs)
        return original(self, model, trust_remote_code, revision, code_revision, **kwargs)

    parse._ds4_patched = True  # type: ignore[attr-defined]
    parser.parse = parse


def _parse_as_ds4(
    model: Any, revision: str | None, code_revision: str | None, kwargs: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    import huggingface_hub
    from transformers import PreTrainedConfig

    from ds4_vllm.model.config import Ds4Config

    kwargs = {k: v for k, v in kwargs.items() if k not in ("hf_overrides", "trust_remote_code")}
    kwargs["local_files_only"] = huggingface_hub.constants.HF_HUB_OFFLINE
    config_dict, _ = PreTrainedConfig.get_config_dict(
        model, revision=revision, code_revision=code_revision, **kwargs
    )
    if config_dict.get("model_type") != Ds4Config.model_type:
        logger.info("Loading %s (model_type %r) as Ds4Config", model, config_dict.get("model_type"))
    return config_dict, Ds4Config.from_config_dict(config_dict)


def _rewrite_serve_argv() -> None:
    """Rewrite `vllm serve` arguments before vLLM parses them (`--model ds4`, `--kv-connector`).

    `vllm serve` loads general plugins while building its parser, before `parse_args()` reads
    `sys.argv` (spec §6). Only the launching process rewrites: children spawned by vLLM inherit
    the already-rewritten argv and receive parsed configs anyway.
    """
    if multiprocessing.parent_process() is not None:
        return
    from ds4_vllm.cli.vllm_args import ArgvError, rewrite_serve_argv

    def model_dir() -> str:
        from ds4_vllm.model.default_model import default_model_dir

        return str(default_model_dir())

    try:
        sys.argv[1:] = rewrite_serve_argv(sys.argv[1:], model_dir)
    except ArgvError as e:
        sys.stderr.write(f"vllm serve: error: {e}\n")
        raise SystemExit(2) from None
