"""A checkout without ../shared skips the byte-compatibility tests locally and fails them under CI=true."""

from __future__ import annotations

from pathlib import Path

import pytest
from _pytest.outcomes import Failed, Skipped

from tests.shared_data import ENGINE_TESTDATA, require


def test_missing_shared_data_fails_under_ci(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(Failed, match="under CI=true a missing file is a failure"):
        require(tmp_path / "absent" / "manifest.json", "the ds4 engine's test files")


def test_missing_shared_data_skips_locally(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(Skipped, match="../shared must sit beside the repository"):
        require(tmp_path / "absent", "the ds4 engine's test files")


def test_the_engine_files_are_where_the_tests_look() -> None:
    require(ENGINE_TESTDATA / "manifest.json", "the ds4 engine's test files")
    assert sorted(ENGINE_TESTDATA.glob("q2/*.kv"))
