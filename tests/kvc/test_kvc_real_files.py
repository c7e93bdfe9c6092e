"""Real files written by the ds4 engine (shared/testdata/ds4-engine): verify, inspect, round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4_vllm.kvc import CheckpointIndex, open_checkpoint, write_checkpoint
from ds4_vllm.kvc.payload_layout import payload_size
from tests.kvc.kvc_helpers import TESTDATA, real_files, require_testdata, run_cli

# inspect --json names for the manifest's payload_header keys (ours are snake_case)
PAYLOAD_KEYS = {"ctx": "ctx_size", "T": "n_tokens", "idx_dim": "index_dim"}


def _manifest_files() -> list[dict]:
    path = TESTDATA / "manifest.json"
    return json.loads(path.read_text())["files"] if path.is_file() else []


@pytest.fixture(autouse=True)
def _need_testdata() -> None:
    require_testdata()


def test_every_file_is_in_the_manifest() -> None:
    assert sorted(str(p.relative_to(TESTDATA)) for p in real_files()) == sorted(
        f["path"] for f in _manifest_files()
    )
    assert len(real_files()) == 12


def test_verify_accepts_all_real_files() -> None:
    dirs = sorted({str(p.parent) for p in real_files()})
    proc = run_cli("verify", *dirs)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert "12 files checked, 12 valid, 0 bad" in proc.stdout.decode()


@pytest.mark.parametrize("entry", _manifest_files(), ids=lambda f: f["path"])
def test_inspect_json_matches_manifest(entry: dict) -> None:
    proc = run_cli("inspect", "--json", str(TESTDATA / entry["path"]), check=True)
    doc = json.loads(proc.stdout)
    for key in (
        "size",
        "reason",
        "reason_name",
        "quant_bits",
        "ext_flags",
        "key_kind",
        "tokens",
        "hits",
        "ctx_size",
        "created_at",
        "last_used",
        "text_bytes",
        "payload_bytes",
        "trailer_bytes",
        "n_comp",
        "n_index_comp",
        "ktm_ids",
    ):
        assert doc[key] == entry[key], key
    expected_header = {PAYLOAD_KEYS.get(k, k): v for k, v in entry["payload_header"].items()}
    assert doc["payload_header"] == expected_header
    assert doc["name_matches_text"] is True and doc["trailing_bytes"] == 0
    assert doc["ktm_entries"] == len(entry["ktm_ids"])
    assert [lay["ratio"] for lay in doc["layers"]] == [0, 0, 4, 128, 4, 128]
    raw_live = entry["payload_header"]["raw_live"]
    assert doc["layers"][2]["sections"]["comp"]["shape"] == [entry["n_comp"][2], 128]
    assert doc["layers"][2]["sections"]["index_state_kv"]["shape"] == [8, 128]
    assert doc["layers"][3]["sections"]["state_kv"]["shape"] == [128, 128]
    assert doc["layers"][0]["sections"]["raw"]["shape"] == [raw_live, 128]


@pytest.mark.parametrize("path", real_files(), ids=lambda p: f"{p.parent.name}/{p.name[:8]}")
def test_read_then_write_back_byte_identical(path: Path, tmp_path: Path) -> None:
    original = path.read_bytes()
    with open_checkpoint(path) as ck:
        assert (
            payload_size(ck.payload.header, ck.payload.n_comp, ck.payload.n_index_comp)
            == ck.header.payload_bytes
        )
        out = write_checkpoint(tmp_path, ck.text, ck.header, ck.payload, ck.tool_map.entries, fsync=False)
        del ck
    assert out.name == path.name
    assert out.read_bytes() == original


def test_index_and_lookup_on_real_files() -> None:
    idx = CheckpointIndex(TESTDATA / "q2")
    idx.refresh()
    assert len(idx) == 8 and not idx.invalid
    longest = max(idx.entries, key=lambda e: e.text_bytes)
    prompt = longest.text + b"<|User|>next turn"
    res = idx.lookup(prompt, min_tokens=512, ctx_size=16384)
    assert res.hit is not None and res.hit.path == longest.path
    assert idx.lookup(prompt, min_tokens=512, ctx_size=8192).hit is None
