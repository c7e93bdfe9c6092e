"""`ds4-vllm serve ...`: vLLM's `serve` with ds4's defaults and conveniences, rewritten before vLLM sees them.

With no flags it serves the product: the embedded model `ds4` with ds4disk checkpoints in the
per-user cache folder (`apply_serve_defaults`; `--no-kv-disk` serves without them).

The arguments go through `ds4_vllm.cli.vllm_args` (`--model ds4` → the default model directory,
`--kv-connector` and the ds4 cache flags → `--kv-transfer-config`) and then to vLLM's own CLI,
the `vllm` command, so every `vllm serve` flag works as usual. Plain `vllm serve` with the same
arguments works too, through the plugin's `sys.argv` rewrite (`ds4_vllm.vllm_compat`); this
command does not depend on vLLM loading plugins before it parses its arguments.
"""

from __future__ import annotations

import sys

from ds4_vllm.cli.vllm_args import NO_KV_DISK_FLAG, ArgvError, apply_serve_defaults, rewrite_serve_argv
from ds4_vllm.store.options import SETTINGS, setting_flag

_VALUE_NAMES = {int: " N", str: " PATH", bool: "[=true|false]"}


def usage() -> str:
    """The help text; the cache flags come from the settings table."""
    flags = "\n".join(
        f"  {setting_flag(key)}{_VALUE_NAMES[setting.kind]}" for key, setting in SETTINGS.items()
    )
    return (
        "usage: ds4-vllm serve [MODEL] [vllm serve flags] [--kv-connector NAME] [ds4 cache flags]\n"
        f"       ds4-vllm serve [MODEL] [vllm serve flags] {NO_KV_DISK_FLAG}\n\n"
        "Runs `vllm serve` after rewriting ds4's conveniences: MODEL is `ds4` (the embedded default\n"
        "model) when not given; a ds4 model is served with the ds4disk connector, its checkpoints in\n"
        f"~/.cache/ds4-vllm/kvcache/<model> unless --kv-disk-dir says where ({NO_KV_DISK_FLAG}: none);\n"
        "the ds4 cache flags (docs/connector.md) become --kv-transfer-config for --kv-connector NAME\n"
        "(ds4disk when not given). `ds4-vllm serve --help` shows vLLM's flags.\n\n"
        "       ds4-vllm ray-serve [MODEL] --replicas N --kv-disk-dir DIR|s3://BUCKET/PREFIX [ds4 cache flags]\n\n"
        "Deploys ds4 as a Ray Serve LLM app on an existing Ray cluster (docs/ray.md);\n"
        "`ds4-vllm ray-serve --help` shows its options.\n\n"
        f"ds4 cache flags:\n{flags}\n"
    )


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `ds4-vllm` console script."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args[:1] == ["ray-serve"]:
        from ds4_vllm.cli.ray_serve import main as ray_serve_main

        ray_serve_main(args[1:])
        return
    if args[:1] != ["serve"]:
        asked_for_help = args[:1] in (["-h"], ["--help"])
        (sys.stdout if asked_for_help else sys.stderr).write(usage())
        raise SystemExit(0 if asked_for_help else 2)
    try:
        args = rewrite_serve_argv(apply_serve_defaults(args), _default_model_dir)
    except ArgvError as e:
        sys.stderr.write(f"ds4-vllm serve: error: {e}\n")
        raise SystemExit(2) from None

    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = [sys.argv[0], *args]  # vLLM's CLI reads its arguments from sys.argv
    vllm_main()


def _default_model_dir() -> str:
    from ds4_vllm.model.default_model import default_model_dir

    return str(default_model_dir())


if __name__ == "__main__":
    main()
