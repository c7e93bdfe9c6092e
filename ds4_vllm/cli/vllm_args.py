"""Rewrite ds4 conveniences in a `vllm serve` command line into plain vLLM arguments.

vLLM has no hook for new CLI flags, but `vllm serve` loads general plugins before it parses
`sys.argv` (spec §6), so `ds4_vllm.register()` applies these pure functions to `sys.argv[1:]`:

- `--model ds4` / `--model=ds4` / positional `ds4` → the embedded default model directory
  (plus `--served-model-name ds4` so clients keep asking for model "ds4");
- `--kv-connector NAME` and the ds4 cache flags (`--kv-disk-dir DIR`, ...) →
  `--kv-transfer-config '{"kv_connector": NAME, "kv_role": "kv_both",
  "kv_connector_extra_config": {"kv_disk_dir": DIR, ...}}'`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable

DEFAULT_MODEL_NAME = "ds4"
DEFAULT_CONNECTOR = "ds4disk"

# ds4 cache flags collected into kv_connector_extra_config, with their value kind:
# "path" (made absolute), "int" (≥ 0), "bool" (bare flag = true, or --flag=true/false).
# The connector owns what they mean; add new flags here.
KV_CACHE_FLAGS: dict[str, str] = {
    "--kv-disk-dir": "path",
    "--kv-disk-space-mb": "int",
    "--kv-cache-min-tokens": "int",
    "--kv-cache-cold-max-tokens": "int",
    "--kv-cache-continued-interval-tokens": "int",
    "--kv-cache-boundary-trim-tokens": "int",
    "--kv-cache-boundary-align-tokens": "int",
    "--kv-cache-reject-different-quant": "bool",
    "--tool-memory-max-ids": "int",
    "--trace": "path",
}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


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

    Adds `--served-model-name ds4` unless given, so the OpenAI/Anthropic APIs still call it "ds4".
    """
    if not mentions_default_model(argv):
        return list(argv)
    idx = _model_value_index(argv)
    assert idx is not None
    out = list(argv)
    out[idx] = f"--model={model_dir}" if out[idx].startswith("--model=") else model_dir
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in out):
        out += ["--served-model-name", DEFAULT_MODEL_NAME]
    return out


def _parse_value(flag: str, kind: str, raw: str) -> str | int | bool:
    if kind == "int":
        try:
            value = int(raw)
        except ValueError:
            raise ArgvError(f"{flag} needs a whole number, got {raw!r}") from None
        if value < 0:
            raise ArgvError(f"{flag} must be ≥ 0, got {value}")
        return value
    if kind == "bool":
        low = raw.lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ArgvError(f"{flag} takes no value or one of true/false, got {raw!r}")
    if not raw:
        raise ArgvError(f"{flag} needs a non-empty path")
    return os.path.abspath(os.path.expanduser(raw))


def _take_value(argv: list[str], i: int, flag: str, kind: str) -> tuple[str, int]:
    """The value after `flag` at argv[i] and the index after it."""
    if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
        what = {"path": "a path", "int": "a whole number"}.get(kind, "a value")
        raise ArgvError(f"{flag} needs {what}, e.g. {flag} {'/tmp/ds4-kv' if kind == 'path' else '1024'}")
    return argv[i + 1], i + 2


def rewrite_kv_connector_args(argv: list[str]) -> list[str]:
    """Fold `--kv-connector NAME` and the ds4 cache flags into one `--kv-transfer-config`.

    The ds4 cache flags alone imply `--kv-connector ds4disk`. Mixing them with an explicit
    `--kv-transfer-config` is an error (put the settings into its kv_connector_extra_config).
    Command lines without any of these flags come back unchanged.
    """
    out: list[str] = []
    connector: str | None = None
    extra: dict[str, str | int | bool] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            out += argv[i:]
            break
        flag, eq, inline = arg.partition("=")
        if flag == "--kv-connector":
            if eq:
                raw, i = inline, i + 1
            else:
                raw, i = _take_value(argv, i, flag, "name")
            if not raw:
                raise ArgvError("--kv-connector needs a connector name, e.g. --kv-connector ds4disk")
            connector = raw
            continue
        kind = KV_CACHE_FLAGS.get(flag)
        if kind is None:
            out.append(arg)
            i += 1
            continue
        if eq:
            raw, i = inline, i + 1
        elif kind == "bool":
            raw, i = "true", i + 1
        else:
            raw, i = _take_value(argv, i, flag, kind)
        extra[flag.removeprefix("--").replace("-", "_")] = _parse_value(flag, kind, raw)

    if connector is None and not extra:
        return list(argv)
    if any(
        a == "--kv-transfer-config" or a.startswith(("--kv-transfer-config=", "--kv-transfer-config."))
        for a in out
    ):
        raise ArgvError(
            "--kv-connector and the ds4 cache flags cannot be combined with --kv-transfer-config; "
            "use one or the other (kv_connector_extra_config takes the same keys with underscores)"
        )
    config = {
        "kv_connector": connector or DEFAULT_CONNECTOR,
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }
    return out + ["--kv-transfer-config", json.dumps(config)]


def rewrite_serve_argv(argv: list[str], model_dir: Callable[[], str]) -> list[str]:
    """Both rewrites for a `vllm serve` command line; `model_dir` is called only when needed."""
    if not is_serve_command(argv):
        return list(argv)
    if mentions_default_model(argv):
        argv = rewrite_model_arg(argv, model_dir())
    return rewrite_kv_connector_args(argv)
