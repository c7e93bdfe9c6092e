"""The type checker passes: mypy, strict on kvc/, store/ and connector/ (`[tool.mypy]` in
pyproject.toml; the rest of the package is followed for types, not reported)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_mypy_strict_passes_on_the_typed_layers() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Success: no issues found" in done.stdout
