"""What ds4-vllm still patches or reads privately in vLLM, one module per tested vLLM release.

Everything vLLM has a public extension point for is registered in `ds4_vllm.register()` (model
class, KV connector, `--config-format ds4`). What has none lives in one module per vLLM minor
release, LMCache-style (`v0_32.py` for 0.32.x). Each such module names every vLLM attribute it
patches or relies on in `PATCHED_NAMES` (and the public ones it uses in `PUBLIC_NAMES`);
tests/test_vllm_compat.py imports all of them, so an upgrade that removes one fails loudly.

`compat_module()` picks the module by `vllm.__version__` (major.minor). A release without a
module of its own is untested: it gets the nearest tested module and a warning, and `apply()`
stops start-up with a clear error if a patched name is gone. To support a new vLLM release,
copy the nearest module, adapt it, and add it to `TESTED_RELEASES`.
"""

from __future__ import annotations

import importlib
import logging
import re
from types import ModuleType
from typing import Any

__all__ = ["TESTED_RELEASES", "apply", "compat_module", "resolve_name"]

#: vLLM (major, minor) → the module holding that release's patches.
TESTED_RELEASES: dict[tuple[int, int], str] = {
    (0, 32): "ds4_vllm.vllm_compat.v0_32",
}

logger = logging.getLogger(__name__)


class VllmCompatError(RuntimeError):
    """The installed vLLM lacks something ds4-vllm patches; the message says what and which vLLM fits."""


def release_of(version: str) -> tuple[int, int] | None:
    """`0.32.0+cpu` → (0, 32); None for versions without a leading major.minor (`dev`)."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def module_name_for(version: str) -> tuple[str, bool]:
    """The compat module for a vLLM version, and whether that release is tested.

    Untested releases get the newest tested release not newer than them (else the oldest).
    """
    release = release_of(version)
    if release in TESTED_RELEASES:
        return TESTED_RELEASES[release], True
    tested = sorted(TESTED_RELEASES)
    older = [r for r in tested if release is not None and r <= release]
    return TESTED_RELEASES[older[-1] if older else tested[0]], False


def compat_module(version: str | None = None) -> ModuleType:
    """The compat module for `version` (default: the installed vLLM); warns when untested."""
    if version is None:
        import vllm

        version = vllm.__version__
    name, tested = module_name_for(version)
    if not tested:
        logger.warning(
            "ds4-vllm is tested with vLLM %s only; vLLM %s is not, using the patches of %s",
            _tested_list(),
            version,
            name.rsplit(".", 1)[-1],
        )
    return importlib.import_module(name)


def apply() -> None:
    """Apply the installed vLLM's patches; a missing patched name stops start-up, named."""
    import vllm

    module = compat_module(vllm.__version__)
    try:
        module.apply()
    except (AttributeError, ImportError) as e:
        raise VllmCompatError(
            f"ds4-vllm cannot patch vLLM {vllm.__version__}: {e}. "
            f"It is tested with vLLM {_tested_list()}; install one of those."
        ) from e


def resolve_name(dotted: str) -> Any:
    """Import `a.b.c.Attr.attr`: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        module_name = ".".join(parts[:split])
        try:
            obj: Any = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name is None or not module_name.startswith(e.name):
                raise  # a real import failure inside the module, not "this is an attribute"
            continue
        for attr in parts[split:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(f"no importable module in {dotted!r}")


def _tested_list() -> str:
    return ", ".join(f"{major}.{minor}.x" for major, minor in sorted(TESTED_RELEASES))
