"""How fast a checkpoint file is restored against a plain read of its bytes: the two timings the
connector benchmark (warm page cache) and the microbenchmarks (cache dropped) compare."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from ds4_vllm.kvc import open_checkpoint


def sequential_read(path: Path, buf: bytearray) -> float:
    """Seconds to read the whole file with `readinto` in chunks of `len(buf)`."""
    view = memoryview(buf)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fp:
        while fp.readinto(view):
            pass
    return time.perf_counter() - t0


def payload_arrays(payload: Any) -> list[np.ndarray]:
    """Tokens, logits and every layer's arrays of a read payload."""
    arrays = [payload.tokens, payload.logits]
    for layer in payload.layers:
        arrays += [a for a in (getattr(layer, f.name) for f in dataclasses.fields(layer)) if a is not None]
    return arrays


def checkpoint_restore(path: Path, dst: np.ndarray) -> float:
    """Seconds for open_checkpoint (validate + map) plus copying every payload array into `dst`."""
    t0 = time.perf_counter()
    with open_checkpoint(path) as ck:
        at = 0
        for a in payload_arrays(ck.payload):
            np.copyto(dst[at : at + a.size].reshape(a.shape), a, casting="unsafe")
            at += a.size
    return time.perf_counter() - t0
