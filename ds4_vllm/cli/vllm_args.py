"""Rewrite ds4 conveniences in a `vllm serve` command line into plain vLLM arguments.

vLLM has no hook for new CLI flags, so these pure functions rewrite the arguments before vLLM
parses them: `ds4-vllm serve` (`ds4_vllm.cli.main`) applies them to its own arguments, and for
plain `vllm serve` the plugin applies them to `sys.argv` (`ds4_vllm.vllm_compat`, which says why):

- `--model ds4` / `--model=ds4` / positional `ds4` → the embedded default model directory
  (plus `--served-model-name ds4` and the ds4 engine's model names, so clients keep asking
  for model "ds4");
- `--kv-connector NAME` and the ds4 cache flags (`--kv-disk-dir DIR`, ...) →
  `--kv-transfer-config '{"kv_connector": NAME, "kv_role": "kv_both",
  "kv_connector_extra_config": {"kv_disk_dir": DIR, ...}}'` (for ds4disk also
  `"kv_load_failure_policy": "recompute"`, and `--shutdown-timeout 5` unless given);
- a ds4 model (`ds4_vllm.serving.startup.is_ds4_model_arg`) → plus the API-server flags ds4
  serving needs (`serving_flags`: the raw-body middleware, the tool-call parser), unless given.

The ds4 cache flags, their kinds and bounds come from the one settings table,
`ds4_vllm.store.options.SETTINGS`, and are parsed by the same code as
`kv_connector_extra_config`, so both spellings accept the same values with the same messages.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from ds4_vllm.model.embedded import DEFAULT_MODEL_NAME
from ds4_vllm.store.options import (
    SETTINGS,
    StoreConfigError,
    StoreOptions,
    flag_names,
    is_local_dir,
    setting_flag,
    setting_for,
)

DEFAULT_CONNECTOR = "ds4disk"
#: vLLM's default (0) kills the engine at once on SIGTERM; ds4disk needs a few seconds of vLLM's
#: graceful drain to save running requests as `shutdown` checkpoints. Below Docker's 10 s stop grace.
DEFAULT_SHUTDOWN_TIMEOUT_S = 5

#: ds4 cache flag → its `kv_connector_extra_config` key, for every setting in SETTINGS.
KV_CACHE_FLAGS: dict[str, str] = {setting_flag(key): key for key in SETTINGS}


class ArgvError(ValueError):
    """A ds4 command-line flag is malformed; the message says which and why."""


def is_serve_command(argv: list[str]) -> bool:
    """True for `vllm serve ...` (argv without the program name)."""
    return argv[:1] == ["serve"]


def _model_value_index(argv: list[str]) -> int | None:
    """Index of the token holding the model name in a `serve` command line, if any."""
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--model":
            if i + 1 >= len(argv):
                raise ArgvError("--model needs a value (a model directory, a hub id, or 'ds4')")
            return i + 1
        if arg.startswith("--model="):
            return i
    if len(argv) > 1 and not argv[1].startswith("-"):
        return 1  # `vllm serve MODEL ...`
    return None


def _value_at(argv: list[str], idx: int) -> str:
    arg = argv[idx]
    return arg.removeprefix("--model=") if arg.startswith("--model=") else arg


def mentions_default_model(argv: list[str]) -> bool:
    """Whether a `vllm serve` command line asks for the embedded default model `ds4`."""
    if not is_serve_command(argv):
        return False
    idx = _model_value_index(argv)
    return idx is not None and _value_at(argv, idx) == DEFAULT_MODEL_NAME


def rewrite_model_arg(argv: list[str], model_dir: str) -> list[str]:
    """Replace the model name `ds4` by `model_dir`; other command lines come back unchanged.

    Adds `--served-model-name ds4` (and the ds4 engine's model names) unless given, so the
    OpenAI/Anthropic APIs still call it "ds4".
    """
    if not mentions_default_model(argv):
        return list(argv)
    idx = _model_value_index(argv)
    assert idx is not None
    out = list(argv)
    out[idx] = f"--model={model_dir}" if out[idx].startswith("--model=") else model_dir
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in out):
        from ds4_vllm.serving.startup import served_names_flag

        out += served_names_flag(DEFAULT_MODEL_NAME)
    return out


def _absolute_path(value: str) -> str:
    """Local paths relative to the launching directory become absolute; URLs stay as given."""
    if is_local_dir(value) and not value.startswith("file://"):
        return os.path.abspath(os.path.expanduser(value))
    return value


def _cache_flag_value(argv: list[str], i: int, key: str, inline: str | None) -> tuple[Any, int]:
    """The parsed value of the ds4 cache flag at argv[i] and the index after it.

    A bare boolean flag means true; other flags take `--flag=VALUE` or `--flag VALUE`.
    """
    setting = setting_for(key)
    if inline is not None:
        raw, i = inline, i + 1
    elif setting.kind is bool:
        raw, i = "true", i + 1
    elif i + 1 >= len(argv) or argv[i + 1].startswith("--"):
        raise ArgvError(f"{flag_names(key)}: expected {setting.kind_name}, got no value")
    else:
        raw, i = argv[i + 1], i + 2
    value = setting.parse(key, raw)
    if setting.kind is str and value is not None:
        value = _absolute_path(value)
    return value, i


def rewrite_kv_connector_args(argv: list[str]) -> list[str]:
    """Fold `--kv-connector NAME` and the ds4 cache flags into one `--kv-transfer-config`.

    The ds4 cache flags alone imply `--kv-connector ds4disk`. Mixing them with an explicit
    `--kv-transfer-config` is an error (put the settings into its kv_connector_extra_config).
    For `ds4disk` the settings are also checked together (as the connector will at start-up),
    so a bad combination stops here with the same message, and vLLM's load-failure policy is
    set to "recompute", which ds4disk requires (a checkpoint that fails to load costs a
    prefill, not the request), and, unless given, `--shutdown-timeout 5` (a SIGTERM then
    saves running requests as `shutdown` checkpoints). Command lines without any of these
    flags come back unchanged.
    """
    try:
        out, connector, extra = _collect_kv_flags(argv)
        if connector is None and not extra:
            return list(argv)
        connector = connector or DEFAULT_CONNECTOR
        if connector == DEFAULT_CONNECTOR:
            StoreOptions.from_extra_config(extra)
    except StoreConfigError as e:
        raise ArgvError(str(e)) from None
    if any(
        a == "--kv-transfer-config" or a.startswith(("--kv-transfer-config=", "--kv-transfer-config."))
        for a in out
    ):
        raise ArgvError(
            "--kv-connector and the ds4 cache flags cannot be combined with --kv-transfer-config; "
            "use one or the other (kv_connector_extra_config takes the same keys with underscores)"
        )
    config: dict[str, Any] = {
        "kv_connector": connector,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    if connector == DEFAULT_CONNECTOR:
        config["kv_load_failure_policy"] = "recompute"
        if not any(a == "--shutdown-timeout" or a.startswith("--shutdown-timeout=") for a in out):
            out += ["--shutdown-timeout", str(DEFAULT_SHUTDOWN_TIMEOUT_S)]
    return out + ["--kv-transfer-config", json.dumps(config)]


def _collect_kv_flags(argv: list[str]) -> tuple[list[str], str | None, dict[str, Any]]:
    """Split `--kv-connector` and the ds4 cache flags (parsed) off the other arguments."""
    out: list[str] = []
    connector: str | None = None
    extra: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        flag, eq, inline = arg.partition("=")
        if flag == "--kv-connector":
            if eq:
                connector, i = inline, i + 1
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                connector, i = argv[i + 1], i + 2
            else:
                connector = ""
            if not connector:
                raise ArgvError("--kv-connector needs a connector name, e.g. --kv-connector ds4disk")
            continue
        key = KV_CACHE_FLAGS.get(flag)
        if key is None:
            out.append(arg)
            i += 1
            continue
        extra[key], i = _cache_flag_value(argv, i, key, inline if eq else None)
    return out, connector, extra


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last value given for `--flag VALUE` / `--flag=VALUE`, if any."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def add_serving_flags(argv: list[str]) -> list[str]:
    """Append the ds4 API-server flags (`serving_flags`) when the command line serves a ds4 model."""
    from ds4_vllm.serving.startup import is_ds4_model_arg, serving_flags

    idx = _model_value_index(argv)
    model = _value_at(argv, idx) if idx is not None else None
    if not is_ds4_model_arg(model, _flag_value(argv, "--config-format")):
        return list(argv)
    return list(argv) + serving_flags(argv, model)


#: `ds4-vllm serve` serves with ds4disk unless this flag says otherwise (not a vLLM flag).
NO_KV_DISK_FLAG = "--no-kv-disk"


def _names_kv_connector(argv: list[str]) -> bool:
    """Whether a command line chooses a KV connector or ds4 cache settings itself."""
    for arg in argv:
        if arg == "--":
            break
        flag = arg.partition("=")[0]
        if flag in ("--kv-connector", "--kv-transfer-config") or flag in KV_CACHE_FLAGS:
            return True
        if flag.startswith("--kv-transfer-config."):
            return True
    return False


def apply_serve_defaults(argv: list[str]) -> list[str]:
    """`ds4-vllm serve`'s defaults: the model `ds4`, served with ds4disk checkpoints.

    No model → `ds4`. A ds4 model with no connector or cache flag gets `--kv-connector ds4disk`
    (checkpoints in the per-user cache folder, `StoreOptions.for_model`); `--no-kv-disk` serves
    without checkpoints, and contradicting it with a connector or cache flag is an error. Plain
    `vllm serve` has no such defaults: it stays vLLM's command.
    """
    if not is_serve_command(argv):
        return list(argv)
    out = [a for a in argv if a != NO_KV_DISK_FLAG]
    no_kv_disk = len(out) != len(argv)
    if _model_value_index(out) is None:
        out.insert(1, DEFAULT_MODEL_NAME)
    if no_kv_disk:
        if _names_kv_connector(out):
            raise ArgvError(
                f"{NO_KV_DISK_FLAG} serves without checkpoints; it cannot be combined with "
                "--kv-connector, --kv-transfer-config or the ds4 cache flags"
            )
        return out
    from ds4_vllm.serving.startup import is_ds4_model_arg

    idx = _model_value_index(out)
    model = _value_at(out, idx) if idx is not None else None
    is_ds4 = model == DEFAULT_MODEL_NAME or is_ds4_model_arg(model, _flag_value(out, "--config-format"))
    if is_ds4 and not _names_kv_connector(out):
        out += ["--kv-connector", DEFAULT_CONNECTOR]
    return out


def rewrite_serve_argv(argv: list[str], model_dir: Callable[[], str]) -> list[str]:
    """All rewrites for a `vllm serve` command line; `model_dir` is called only when needed."""
    if not is_serve_command(argv):
        return list(argv)
    if mentions_default_model(argv):
        argv = rewrite_model_arg(argv, model_dir())
    return add_serving_flags(rewrite_kv_connector_args(argv))
