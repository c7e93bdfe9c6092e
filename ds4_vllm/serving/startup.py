"""How a ds4 model gets the ds4 tokenizer, renderer and serving flags with no user flag.

Tokenizer and renderer: vLLM picks both from one name, `ModelConfig.tokenizer_mode`, and sets it
itself from the resolved architecture when it is "auto" (e.g. DeepseekV4ForCausalLM ->
"deepseek_v4"). `select_tokenizer_mode` applies the same rule for our architecture right after
vLLM built the model config (the patched `EngineArgs.create_model_config`, `ds4_vllm.vllm_compat`):
tokenizer_mode "auto" and architecture `Ds4ForCausalLM` -> "ds4". An explicit
`--tokenizer-mode` is kept. This covers every way of naming a ds4 model (embedded names, GGUF
files, `model_type: ds4` directories, `--config-format ds4`, hub ids), offline `LLM(...)` too.

`vllm serve` flags: the raw-body middleware and the tool-call parser are options of vLLM's API
server, not of the engine config, so the `vllm serve` command line rewrite
(`ds4_vllm.cli.vllm_args`) appends `serving_flags()` when `is_ds4_model_arg` recognises the model
from the command line alone (embedded names, ds4 GGUF files, local `model_type: ds4` directories,
`--config-format ds4`). Without `--served-model-name` the server also answers to the ds4 engine's
model names (`deepseek-v4-flash`, `deepseek-chat`, `deepseek-reasoner`; the last two select thinking
as in the engine), after the model's own name. A hub id is not downloaded for this; such a server renders from vLLM's
parsed messages until the flags are given by hand.

`VLLM_PLUGINS`: vLLM loads only the `vllm.general_plugins` entry points it names when it is set.
ds4-vllm is the entry point `ds4`, so a user who sets it must include `ds4`
(e.g. `VLLM_PLUGINS=ds4,other`); without it nothing of ds4-vllm is loaded, in any process.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ds4_vllm.chat.thinking import ENGINE_MODEL_NAMES
from ds4_vllm.serving.parsers import PARSER_NAME

TOKENIZER_MODE = "ds4"
TOKENIZER_LOADER = ("ds4_vllm.serving.tokenizer", "Ds4TokenizerLoader")
RENDERER_CLASS = ("ds4_vllm.serving.renderer", "Ds4Renderer")
#: `--config-format` of DeepSeek V4 directories read as ds4 (`ds4_vllm.model.config_parser`, which
#: imports vLLM; the command line is judged before vLLM is imported).
CONFIG_FORMAT = "ds4"
GGUF_MAGIC = b"GGUF"
#: The raw request body for the renderer, usage fields on every response and the counters of
#: GET /v1/kv_cache, as one middleware (`Ds4Middleware` says why one).
DS4_MIDDLEWARE = "ds4_vllm.serving.middleware.Ds4Middleware"

#: The `vllm serve` flags a ds4 model is served with, as (flag, value or None for a switch).
SERVE_FLAGS: list[tuple[str, str | None]] = [
    ("--middleware", DS4_MIDDLEWARE),
    ("--enable-auto-tool-choice", None),
    ("--tool-call-parser", PARSER_NAME),
    ("--reasoning-parser", PARSER_NAME),
]


def register_tokenizer_and_renderer() -> None:
    """Register mode `ds4` in vLLM's tokenizer and renderer registries (by name; imported on use)."""
    from vllm.renderers.registry import RENDERER_REGISTRY
    from vllm.tokenizers.registry import TokenizerRegistry

    if TOKENIZER_MODE not in TokenizerRegistry.tokenizers:
        TokenizerRegistry.register(TOKENIZER_MODE, *TOKENIZER_LOADER)
    if TOKENIZER_MODE not in RENDERER_REGISTRY.renderers:
        RENDERER_REGISTRY.register(TOKENIZER_MODE, *RENDERER_CLASS)


def select_tokenizer_mode(model_config: Any) -> bool:
    """Set tokenizer_mode "ds4" for a ds4 model left on "auto"; True when it did."""
    from ds4_vllm.model.config import DS4_ARCHITECTURE

    if model_config is None or model_config.tokenizer_mode != "auto":
        return False
    if model_config.architecture != DS4_ARCHITECTURE:
        return False
    model_config.tokenizer_mode = TOKENIZER_MODE
    return True


def is_ds4_model_arg(model: str | None, config_format: str | None = None) -> bool:
    """Whether a `vllm serve` model argument names a ds4 model, judged from local files only."""
    from ds4_vllm.model.embedded import EMBEDDED_GGUF_MODELS

    if config_format == CONFIG_FORMAT:
        return True
    if model is None:
        return False
    if model in EMBEDDED_GGUF_MODELS:
        return True
    path = Path(os.path.expanduser(model))
    try:
        if path.is_file():
            with open(path, "rb") as fp:
                return fp.read(4) == GGUF_MAGIC  # ds4-vllm serves GGUF files as ds4 models only
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    from ds4_vllm.model.config import DS4_ARCHITECTURE, DS4_MODEL_TYPE

    if not isinstance(config, dict):
        return False
    return config.get("model_type") == DS4_MODEL_TYPE or DS4_ARCHITECTURE in (
        config.get("architectures") or []
    )


def _given(argv: Sequence[str], flag: str) -> list[str | None]:
    """Values given for `flag` in argv (None for a bare switch)."""
    values: list[str | None] = []
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            values.append(None if nxt is None or nxt.startswith("-") else nxt)
        elif arg.startswith(flag + "="):
            values.append(arg[len(flag) + 1 :])
    return values


def served_names_flag(model_name: str) -> list[str]:
    """`--served-model-name` with the model's own name first, then the ds4 engine's names."""
    return ["--served-model-name", model_name, *ENGINE_MODEL_NAMES]


def serving_flags(argv: Sequence[str], model_name: str | None = None) -> list[str]:
    """The `SERVE_FLAGS` a `vllm serve` command line lacks, to append to it.

    A flag the user gave keeps the user's value (e.g. their own `--tool-call-parser`); only
    `--middleware`, which vLLM accepts several times, is added next to the user's own ones.
    Without `--served-model-name`, `model_name` (as vLLM would call the model) and the engine's
    names are served.
    """
    out: list[str] = []
    if model_name is not None and not _given(argv, "--served-model-name"):
        out += served_names_flag(model_name)
    for flag, value in SERVE_FLAGS:
        given = _given(argv, flag)
        if flag == "--middleware" and value not in given:
            out += [flag, value]  # type: ignore[list-item]
        elif not given:
            out += [flag] if value is None else [flag, value]
    return out
