"""Payloads of random values with a valid layout: for tests, fuzzing seeds and benchmarks.

A checkpoint's values do not matter to the format, the store or the benchmarks of I/O; the
layout (which sections, how many rows) does. One builder, so every user draws the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .payload import LayerArrays, PayloadData
from .payload_layout import ModelDims, PayloadHeader, compute_layout, default_counts


def random_payload(
    dims: ModelDims,
    rng: np.random.Generator,
    *,
    tokens: int | Sequence[int],
    ctx_size: int = 4096,
    raw_window: int | None = None,
    counts: tuple[list[int], list[int]] | None = None,
) -> PayloadData:
    """A payload of standard-normal float32 sections (and logits) for `tokens` (a count: random
    ids below the vocabulary size; or the ids). `counts` overrides the compressed-row counts
    the engine would have after that many tokens. Draws layers, then ids, then logits."""
    n_tokens = tokens if isinstance(tokens, int) else len(tokens)
    header = PayloadHeader.build(dims, ctx_size=ctx_size, n_tokens=n_tokens, raw_window=raw_window)
    n_comp, n_index = counts if counts is not None else default_counts(dims.n_layer, n_tokens)
    layout = compute_layout(header, n_comp, n_index)
    layers = [
        LayerArrays(**{s.name: rng.standard_normal(s.shape).astype(np.float32) for s in lay.sections})
        for lay in layout.layers
    ]
    if isinstance(tokens, int):
        ids = rng.integers(0, dims.n_vocab, size=n_tokens, dtype=np.uint32)
    else:
        ids = np.asarray(tokens, dtype=np.uint32)
    return PayloadData(
        header=header,
        tokens=ids,
        logits=rng.standard_normal(dims.n_vocab).astype(np.float32),
        n_comp=n_comp,
        n_index_comp=n_index,
        layers=layers,
    )
