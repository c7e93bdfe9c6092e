"""Shared helpers for the kvc tests (a plain module: conftest names may clash across test dirs): random payloads of any model shape, the real-file corpus."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from ds4_vllm.kvc import (
    KvcHeader,
    ModelDims,
    PayloadData,
    SaveReason,
    ToolMapEntry,
    synthetic,
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


def random_payload(
    dims: ModelDims,
    n_tokens: int,
    rng: np.random.Generator,
    *,
    ctx_size: int = 4096,
    raw_window: int | None = None,
    counts: tuple[list[int], list[int]] | None = None,
) -> PayloadData:
    return synthetic.random_payload(
        dims, rng, tokens=n_tokens, ctx_size=ctx_size, raw_window=raw_window, counts=counts
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
