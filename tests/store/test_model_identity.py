"""Checkpoints of different models never mix by accident: per-model folders and a directory marker."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ds4_vllm.store.checkpoint_store import CheckpointStore
from ds4_vllm.store.model_identity import MODEL_MARKER, model_fingerprint, model_label
from ds4_vllm.store.options import StoreConfigError, StoreOptions, default_disk_dir
from tests.store.store_helpers import opts


def model_dir(path: Path, weights: bytes, config: dict | None = None) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or {"model_type": "ds4", "hidden_size": 256}))
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_fingerprint_follows_the_weights_not_the_location(tmp_path: Path) -> None:
    a = model_dir(tmp_path / "a", b"\x01" * 4096)
    moved = tmp_path / "elsewhere" / "a"
    shutil.copytree(a, moved)
    tuned = model_dir(tmp_path / "tuned", b"\x01" * 4095 + b"\x02")  # same shape, other values
    other_config = model_dir(tmp_path / "c", b"\x01" * 4096, {"model_type": "ds4", "hidden_size": 512})
    assert model_fingerprint(str(a)) == model_fingerprint(str(moved))
    assert model_fingerprint(str(a)) != model_fingerprint(str(tuned))
    assert model_fingerprint(str(a)) != model_fingerprint(str(other_config))
    assert model_fingerprint("org/name") != model_fingerprint("org/name", "v2")
    assert model_label("/models/DeepSeek V4 Flash/") == "DeepSeek_V4_Flash"


def test_default_directory_is_per_model() -> None:
    options = StoreOptions().validate()
    assert options.for_model("ds4-tiny-v2-0123456789ab").disk_dir == str(
        Path(default_disk_dir()) / "ds4-tiny-v2-0123456789ab"
    )
    given = StoreOptions(disk_dir="/srv/kv").validate()
    assert given.for_model("x").disk_dir == "/srv/kv"  # the user's directory is used as given


def test_directory_is_claimed_then_refused_to_another_model(tmp_path: Path) -> None:
    CheckpointStore(opts(tmp_path), model_fingerprint="a" * 40, fsync=False).open()
    assert json.loads((tmp_path / MODEL_MARKER).read_text()) == {"model_fingerprint": "a" * 40}
    CheckpointStore(opts(tmp_path), model_fingerprint="a" * 40, fsync=False).open()  # same model: fine
    with pytest.raises(StoreConfigError) as err:
        CheckpointStore(opts(tmp_path), model_fingerprint="b" * 40, fsync=False).open()
    message = str(err.value)
    assert "--kv-disk-dir / kv_disk_dir" in message and "another model" in message
    assert "--kv-cache-shared-models / kv_cache_shared_models" in message


def test_sharing_a_directory_on_purpose(tmp_path: Path) -> None:
    CheckpointStore(opts(tmp_path), model_fingerprint="a" * 40, fsync=False).open()
    CheckpointStore(opts(tmp_path, shared_models=True), model_fingerprint="b" * 40, fsync=False).open()
    # the directory stays claimed by the first model
    assert json.loads((tmp_path / MODEL_MARKER).read_text()) == {"model_fingerprint": "a" * 40}
