"""`--config-format ds4`: vLLM reads any DeepSeek V4 directory as our `Ds4Config`.

For `model_type: deepseek_v4` vLLM's own "hf" parser picks vLLM's DeepseekV4Config, and with it
vLLM's DeepSeek V4 special cases (MLA, CPU block size, its tokenizer mode), before any
`--hf-overrides` applies. A registered config format is vLLM's public way to choose the config
class instead: `vllm serve DIR --config-format ds4`, `LLM(DIR, config_format="ds4")`.
Directories that already say `model_type: ds4` (the default model) load without it. A ds4 GGUF
file is read from its `deepseek4.*` metadata (`gguf_serving` selects this format for it).

Imports vLLM: only `ds4_vllm.register()` imports this module.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import huggingface_hub
from transformers import PreTrainedConfig
from vllm.transformers_utils.config import get_config_parser, register_config_parser
from vllm.transformers_utils.config_parser_base import ConfigParserBase

from ds4_vllm.model.config import DS4_ARCHITECTURE, DS4_MODEL_TYPE, Ds4Config
from ds4_vllm.model.gguf_file import Ds4GgufFile
from ds4_vllm.model.gguf_serving import is_gguf_file

CONFIG_FORMAT = "ds4"
#: config.json model types this format reads: ours and transformers' DeepSeek V4.
READABLE_MODEL_TYPES = (DS4_MODEL_TYPE, "deepseek_v4")

logger = logging.getLogger(__name__)


class Ds4ConfigParser(ConfigParserBase):
    """Parse config.json as `Ds4Config` served by `Ds4ForCausalLM`, whatever its flavour says."""

    def parse(
        self,
        model: str | Path,
        trust_remote_code: bool,
        revision: str | None = None,
        code_revision: str | None = None,
        **kwargs: Any,
    ) -> tuple[dict[str, Any], PreTrainedConfig]:
        # vLLM applies `hf_overrides` to the result itself; no remote code is involved.
        if is_gguf_file(model):
            config = Ds4GgufFile.open(model).config()
            config.name_or_path = str(model)
            return config.to_dict(), config
        kwargs = {k: v for k, v in kwargs.items() if k not in ("hf_overrides", "trust_remote_code")}
        kwargs.setdefault("local_files_only", huggingface_hub.constants.HF_HUB_OFFLINE)
        config_dict, _ = PreTrainedConfig.get_config_dict(
            model, revision=revision, code_revision=code_revision, **kwargs
        )
        model_type = config_dict.get("model_type")
        if model_type not in READABLE_MODEL_TYPES:
            raise ValueError(
                f"--config-format {CONFIG_FORMAT} reads DeepSeek V4 directories (model_type "
                f"{' or '.join(map(repr, READABLE_MODEL_TYPES))}); {model} has model_type {model_type!r}"
            )
        config = Ds4Config.from_config_dict(config_dict)
        if config.architectures != [DS4_ARCHITECTURE]:
            logger.info(
                "Loading %s (model_type %r, architectures %s) as Ds4Config for %s",
                model,
                model_type,
                config.architectures,
                DS4_ARCHITECTURE,
            )
            config.architectures = [DS4_ARCHITECTURE]
        config.name_or_path = str(model)
        # vLLM takes `quantization_config` from the returned dict, not from the config object, and
        # would apply its FP8 method (refusing float32) to a model that dequantizes its own
        # weights; the config keeps it as `checkpoint_quantization`.
        config_dict = {k: v for k, v in config_dict.items() if k != "quantization_config"}
        return config_dict, config


def needs_ds4_config_format(model: str | Path) -> bool:
    """True for a local directory holding transformers' form of a DeepSeek V4 config.

    vLLM's own `DeepseekV4Config` reads the official form but rejects transformers' (its
    `mlp_layer_types` say `hash_moe`/`moe`), so any vLLM code path that reads such a directory
    without `--config-format ds4` must be pointed here.
    """
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # vLLM reports the unreadable file itself
    return (
        isinstance(config, dict)
        and config.get("model_type") == "deepseek_v4"
        and isinstance(config.get("mlp_layer_types"), list)
    )


def register_config_format() -> None:
    """Make `--config-format ds4` known to vLLM (once per process: re-registering logs a warning)."""
    try:
        registered = isinstance(get_config_parser(CONFIG_FORMAT), Ds4ConfigParser)
    except ValueError:  # vLLM's answer for an unknown format
        registered = False
    if not registered:
        register_config_parser(CONFIG_FORMAT)(Ds4ConfigParser)
