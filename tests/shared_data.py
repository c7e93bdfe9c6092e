"""Where the shared test data lives (`../shared` beside the repository), and what a test does without it.

The byte-compatibility tests read files and tools made by the ds4 engine. A local checkout
without `../shared` skips them; under `CI=true` a missing file fails them instead, so CI cannot
pass without checking the project's central claim (files interchangeable with the engine's).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
ENGINE_TESTDATA = SHARED / "testdata" / "ds4-engine"
TINY_GGUF_MAKE_SH = SHARED / "tools" / "ds4-tiny-gguf" / "make.sh"


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(path: Path, what: str) -> None:
    """Skip (fail under CI=true) unless `path` exists; usable in a test, a fixture or a module body."""
    if path.exists():
        return
    message = f"{what} not found at {path} (../shared must sit beside the repository)"
    if in_ci():
        pytest.fail(f"{message}; under CI=true a missing file is a failure, not a skip", pytrace=False)
    pytest.skip(message, allow_module_level=True)
