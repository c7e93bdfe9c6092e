"""Which model a checkpoint directory belongs to, so two models' checkpoints never mix by accident.

KVC files carry the payload's dims but no model identity (the ds4 engine's format has none), so
two models of the same shape (a fine-tune, another quantization) would load each other's
state. The store therefore records a fingerprint of the model in the directory
(`MODEL_MARKER`) and refuses a directory marked by another model, unless the user shares it
on purpose (`--kv-cache-shared-models`). The default directory is per model already.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from .fs import CheckpointFS
from .options import StoreConfigError, StoreOptions, flag_names

#: The file in a checkpoint directory naming the model that writes there (not a `.kv`: ds4 ignores it).
MODEL_MARKER = "ds4-vllm-model.json"
#: Weight files are fingerprinted by name, size and their first bytes (headers and first tensors).
HEAD_BYTES = 1 << 20
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt")


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """A stable digest of a model: its config and weight files (local dir or file) or its name (hub id).

    Moving a local model directory keeps the fingerprint; changing any weight file's size or
    first megabyte (a fine-tune, a re-quantization) changes it.
    """
    h = hashlib.sha1()
    path = Path(model)
    if path.is_file():  # a single weight file (a ds4 GGUF)
        weights = [path]
    elif path.is_dir():
        config = path / "config.json"
        if config.is_file():
            h.update(json.dumps(json.loads(config.read_text()), sort_keys=True).encode())
        weights = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    else:
        h.update(f"hub:{model}@{revision or 'main'}".encode())
        return h.hexdigest()
    for weight in weights:
        h.update(f"{weight.name}:{weight.stat().st_size}:".encode())
        with open(weight, "rb") as fp:
            h.update(fp.read(HEAD_BYTES))
    return h.hexdigest()


def model_label(model: str) -> str:
    """Short directory-safe name for the default per-model checkpoint directory."""
    base = os.path.basename(os.path.normpath(model)) or "model"
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in base)[:64]


def claim_directory(fs: CheckpointFS, options: StoreOptions, fingerprint: str) -> None:
    """Mark an unclaimed directory as this model's; refuse one marked by another model.

    Raises StoreConfigError naming `--kv-disk-dir` and `--kv-cache-shared-models`, unless the
    latter says the sharing is on purpose (the first model's marker then stays).
    """
    raw = fs.read_small(MODEL_MARKER)
    if raw is None:
        fs.write_small(MODEL_MARKER, (json.dumps({"model_fingerprint": fingerprint}) + "\n").encode())
        return
    try:
        theirs = json.loads(raw).get("model_fingerprint")
    except (ValueError, AttributeError):
        theirs = None
    if theirs == fingerprint or options.shared_models:
        return
    raise StoreConfigError(
        f"{flag_names('kv_disk_dir')}: {options.directory!r} holds checkpoints of another model "
        f"({MODEL_MARKER} says {theirs!r}, this model is {fingerprint!r}); use a directory per "
        f"model, or set {flag_names('kv_cache_shared_models')} if the models are meant to share "
        "checkpoints"
    )
