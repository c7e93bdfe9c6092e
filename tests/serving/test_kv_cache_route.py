"""`GET /v1/kv_cache` on a FastAPI app, over a directory of real ds4-engine checkpoint files."""

from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ds4_vllm.serving.kv_cache_route import Ds4KvCacheEndpoint
from ds4_vllm.serving.state import DiskCacheView, ServingState
from ds4_vllm.serving.usage import CacheUsage
from ds4_vllm.serving.usage_counters import COUNTERS_FILE, UsageCounters
from tests.shared_data import ENGINE_TESTDATA, require

ENGINE_FILES = ENGINE_TESTDATA / "q2"
BUDGET = 64 << 20


def app_with(state: ServingState | None) -> TestClient:
    """An app whose engine client's renderer is a ds4 one with `state`, or (None) another model's."""
    app = FastAPI()
    renderer = SimpleNamespace() if state is None else SimpleNamespace(serving=state)
    app.state.engine_client = SimpleNamespace(renderer=renderer)
    Ds4KvCacheEndpoint().attach_router(app)
    return TestClient(app)


@pytest.fixture
def disk_dir(tmp_path) -> Path:
    require(ENGINE_FILES, "the ds4 engine's q2 files")
    for f in ENGINE_FILES.glob("*.kv"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / ("0" * 40 + ".kv")).write_bytes(b"KVC\x01 too short")  # invalid: ignored, as by ds4
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    return tmp_path


def test_route_reports_the_directory_and_the_counters(disk_dir) -> None:
    from ds4_vllm.kvc import CheckpointIndex

    counters = UsageCounters(disk_dir)
    counters.add(CacheUsage.of(1000, 900, 600))
    counters.add(CacheUsage.of(200, 0, 0))
    state = ServingState(
        disk=DiskCacheView(str(disk_dir), BUDGET, CheckpointIndex(disk_dir, keep_text=False)),
        counters=counters,
    )

    report = app_with(state).get("/v1/kv_cache").json()
    engine_files = sorted(ENGINE_FILES.glob("*.kv"))
    assert report == {
        "object": "kv_cache",
        "disk_cache": True,
        "directory": str(disk_dir),
        "entries": len(engine_files),
        "bytes_used": sum(f.stat().st_size for f in engine_files),
        "budget_bytes": BUDGET,
        "requests": 2,
        "prompt_tokens": 1200,
        "prompt_cache_hit_tokens": 900,
        "prompt_cache_miss_tokens": 300,
        "prompt_cache_disk_tokens": 600,
        "hit_rate": 0.75,
        "counters_persistent": True,
    }
    # A file removed by another process (eviction, `ds4-kv gc`) is gone from the next answer.
    (disk_dir / engine_files[0].name).unlink()
    again = app_with(state).get("/v1/kv_cache").json()
    assert again["entries"] == len(engine_files) - 1
    assert (disk_dir / COUNTERS_FILE).is_file()


def test_without_ds4disk_the_route_answers_with_in_memory_counters() -> None:
    report = app_with(ServingState(counters=UsageCounters(None))).get("/v1/kv_cache").json()
    assert (report["disk_cache"], report["directory"], report["entries"], report["bytes_used"]) == (
        False,
        None,
        0,
        0,
    )
    assert (report["hit_rate"], report["counters_persistent"], report["requests"]) == (None, False, 0)


def test_other_models_get_a_clear_404() -> None:
    response = app_with(None).get("/v1/kv_cache")
    assert response.status_code == 404
    assert "not a ds4 model" in response.json()["error"]["message"]


def test_plugin_loads_without_vllm_plugins_and_obeys_it_when_set(monkeypatch) -> None:
    import logging

    import vllm.plugins

    import ds4_vllm

    ds4_vllm.register()  # installs the compat patches
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("vllm.plugins").addHandler(handler)
    try:
        loaded = vllm.plugins.load_endpoint_plugins(("generate",))
    finally:
        logging.getLogger("vllm.plugins").removeHandler(handler)
    assert [p.name for p in loaded] == ["ds4"]
    # No "Found endpoint plugin(s) ['ds4'] but VLLM_PLUGINS is not set" at a default start (issue 24).
    assert not [r for r in records if "VLLM_PLUGINS is not set" in r.getMessage()]
    assert vllm.plugins.load_endpoint_plugins(("transcription",)) == []  # required_tasks respected
    monkeypatch.setenv("VLLM_PLUGINS", "someone_else")
    assert vllm.plugins.load_endpoint_plugins(("generate",)) == []  # vLLM's allowlist rules
