"""Shared helpers for the kvc tests (a plain module: conftest names may clash across test dirs): random payloads of any model shape, the real-file corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from ds4_vllm.kvc import (
    KvcHeader,
    LayerArrays,
    ModelDims,
    PayloadData,
    PayloadHeader,
    SaveReason,
    ToolMapEntry,
    compute_layout,
    default_counts,
)
from tests.shared_data import ENGINE_TESTDATA, require

REPO_ROOT = Path(__file__).resolve().parents[2]
#: CI clones the repo with shared/ beside it: <root>/../shared/testdata/ds4-engine.
TESTDATA = ENGINE_TESTDATA

#: The tiny model of the real files (6 layers, ratios 0,0,4,128,4,128).
TINY = ModelDims(n_layer=6, head_dim=128, index_dim=64, n_vocab=129280)
#: Small enough for hundreds of hypothesis examples and thousands of fuzz cases.
MICRO = ModelDims(n_layer=5, head_dim=8, index_dim=4, n_vocab=32)


def real_files() -> list[Path]:
    return sorted(TESTDATA.glob("*/*.kv")) if TESTDATA.is_dir() else []


def require_testdata() -> Path:
    require(TESTDATA / "manifest.json", "the ds4 engine's test files")
    return TESTDATA


def load_manifest() -> dict:
    root = require_testdata()
    return json.loads((root / "manifest.json").read_text())


def random_layers(
    dims: ModelDims, header: PayloadHeader, n_comp, n_index, rng: np.random.Generator
) -> list[LayerArrays]:
    layout = compute_layout(header, n_comp, n_index)
    layers = []
    for lay in layout.layers:
        arrays = {sec.name: rng.standard_normal(sec.shape).astype(np.float32) for sec in lay.sections}
        layers.append(LayerArrays(**arrays))
    return layers


def random_payload(
    dims: ModelDims,
    n_tokens: int,
    rng: np.random.Generator,
    *,
    ctx_size: int = 4096,
    raw_window: int | None = None,
    counts: tuple[list[int], list[int]] | None = None,
) -> PayloadData:
    header = PayloadHeader.build(dims, ctx_size=ctx_size, n_tokens=n_tokens, raw_window=raw_window)
    n_comp, n_index = counts if counts is not None else default_counts(dims.n_layer, n_tokens)
    return PayloadData(
        header=header,
        tokens=rng.integers(0, dims.n_vocab, size=n_tokens, dtype=np.uint32),
        logits=rng.standard_normal(dims.n_vocab).astype(np.float32),
        n_comp=n_comp,
        n_index_comp=n_index,
        layers=random_layers(dims, header, n_comp, n_index, rng),
    )


def new_header(
    tokens: int, *, quant_bits: int = 2, ctx_size: int = 4096, now: int = 1_767_225_600
) -> KvcHeader:
    return KvcHeader.new(
        quant_bits=quant_bits, reason=SaveReason.COLD, tokens=tokens, ctx_size=ctx_size, now=now
    )


def tool_entries(n: int) -> list[ToolMapEntry]:
    return [
        ToolMapEntry(
            f"call_{i:032x}".encode(),
            f'\n\n<tool_calls>\n<invoke name="f{i}"></invoke></tool_calls>'.encode(),
        )
        for i in range(n)
    ]


def run_cli(*args: str, check: bool = False, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run `ds4-kv` as a real process (the console script may not be installed)."""
    proc = subprocess.run(
        [sys.executable, "-m", "ds4_vllm.cli.kv", *args],
        capture_output=True,
        cwd=cwd or REPO_ROOT,
        timeout=120,
        env={"COLUMNS": "160", "LINES": "50", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)},
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"ds4-kv {' '.join(args)} failed ({proc.returncode}): {proc.stderr.decode()}")
    return proc
