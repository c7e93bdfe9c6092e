"""Fixtures for tests/kvc; the helpers themselves live in kvc_helpers.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# Let the tests run from a plain checkout, before `pip install -e .`.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from kvc_helpers import load_manifest  # noqa: E402


@pytest.fixture(scope="session")
def manifest() -> dict:
    return load_manifest()
