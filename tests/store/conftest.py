"""Fixtures for tests/store; helpers live in store_helpers.py (a plain module)."""

from __future__ import annotations

import sys
from pathlib import Path

# Let the tests run from a plain checkout, before `pip install -e .`.
_ROOT = str(Path(__file__).resolve().parents[2])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
