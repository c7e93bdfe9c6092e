"""Tiny valid checkpoints for store tests: a 5-layer model with 8-wide heads (a few KiB per file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ds4_vllm.kvc import (
    KvcHeader,
    ModelDims,
    PayloadData,
    SaveReason,
    write_checkpoint,
)
from ds4_vllm.kvc.synthetic import random_payload
from ds4_vllm.store.options import StoreOptions

MICRO = ModelDims(n_layer=5, head_dim=8, index_dim=4, n_vocab=64)
#: Same shape with a large vocabulary: ~200 KB files, so a 1 MiB budget holds about five.
WIDE = ModelDims(n_layer=5, head_dim=8, index_dim=4, n_vocab=50000)
NOW = 1_767_225_600


def payload(
    tokens: list[int], *, ctx_size: int = 4096, seed: int = 0, dims: ModelDims = MICRO
) -> PayloadData:
    return random_payload(dims, np.random.default_rng(seed), tokens=tokens, ctx_size=ctx_size)


def header(
    n_tokens: int,
    *,
    reason: SaveReason = SaveReason.CONTINUED,
    quant_bits: int = 2,
    ctx_size: int = 4096,
    now: int = NOW,
) -> KvcHeader:
    return KvcHeader.new(quant_bits=quant_bits, reason=reason, tokens=n_tokens, ctx_size=ctx_size, now=now)


def toks(n: int, start: int = 0) -> list[int]:
    """A deterministic token sequence; its text is `text_of(...)`."""
    return [(start + i) % 60 + 1 for i in range(n)]


def text_of(tokens: list[int]) -> bytes:
    """Every token is 2 bytes of text, so byte offsets are easy to reason about."""
    return b"".join(bytes([65 + t % 26, 97 + t % 26]) for t in tokens)


def put(
    directory: Path,
    tokens: list[int],
    *,
    text: bytes | None = None,
    quant_bits: int = 2,
    ctx_size: int = 4096,
    reason: SaveReason = SaveReason.CONTINUED,
) -> Path:
    """Write a checkpoint directly with kvc (as another server would)."""
    text = text_of(tokens) if text is None else text
    return write_checkpoint(
        directory,
        text,
        header(len(tokens), quant_bits=quant_bits, ctx_size=ctx_size, reason=reason),
        payload(tokens, ctx_size=ctx_size),
        fsync=False,
    )


def opts(directory: Path | str, **kw) -> StoreOptions:
    """Small numbers so tests stay fast: min 8 tokens, big budget unless given."""
    base = dict(disk_dir=str(directory), min_tokens=8, cold_max_tokens=300, disk_space_mb=64)
    base.update(kw)
    return StoreOptions(**base).validate()
