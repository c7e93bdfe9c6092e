"""Tiny valid checkpoints the fuzz corpus is built from (a few hundred bytes to a few KiB each).

`python -m tests.fuzz.seeds` (re)writes `tests/fuzz/corpus/<target>/`: deterministic, so a
rebuild only changes files when the format or this list changes.
"""

from __future__ import annotations

import argparse
import hashlib
import struct
import tempfile
from pathlib import Path

import numpy as np

from ds4_vllm.kvc import (
    KvcHeader,
    ModelDims,
    PayloadData,
    SaveReason,
    ToolMapEntry,
    write_checkpoint,
)
from ds4_vllm.kvc.synthetic import random_payload
from ds4_vllm.kvc.trailer import pack_tool_map

CORPUS = Path(__file__).resolve().parent / "corpus"
#: Two dense layers and one ratio-4 layer: every section kind but the ratio-128 state, in ~600 bytes.
NANO = ModelDims(n_layer=3, head_dim=2, index_dim=1, n_vocab=4)
#: Adds a ratio-128 layer (its state is 128 rows): ~2.6 KiB.
NANO4 = ModelDims(n_layer=4, head_dim=2, index_dim=1, n_vocab=4)
#: Dense only: the smallest legal payload.
DENSE = ModelDims(n_layer=2, head_dim=1, index_dim=0, n_vocab=1)
CTX = 16
NOW = 1_767_225_600


def tool_entries(n: int) -> list[ToolMapEntry]:
    return [ToolMapEntry(f"call_{i:02x}".encode(), f"<invoke f{i}/>".encode()) for i in range(n)]


def payload_data(dims: ModelDims, n_tokens: int, seed: int) -> PayloadData:
    return random_payload(dims, np.random.default_rng(seed), tokens=n_tokens, ctx_size=CTX)


#: (model, tokens, text, KTM entries): each a valid file the writer produced.
SEED_FILES = (
    (NANO, 3, b"a", 0),
    (NANO, 9, b"hello world", 2),
    (NANO, 16, b"", 1),
    (NANO4, 5, "\u00fc".encode() * 3, 0),
    (DENSE, 1, b"x", 0),
    (DENSE, 2, b"<tool_calls>", 3),
)


def seed_checkpoints() -> list[bytes]:
    """The bytes of every seed file (written through `write_checkpoint`, then read back)."""
    out = []
    with tempfile.TemporaryDirectory(prefix="ds4-fuzz-seeds-") as tmp:
        for i, (dims, n_tokens, text, tools) in enumerate(SEED_FILES):
            header = KvcHeader.new(
                quant_bits=2 if i % 2 == 0 else 4,
                reason=SaveReason(1 + i % 6),
                tokens=n_tokens,
                ctx_size=CTX,
                now=NOW,
            )
            path = write_checkpoint(
                tmp, text, header, payload_data(dims, n_tokens, i), tool_entries(tools), fsync=False
            )
            out.append(path.read_bytes())
            path.unlink()
    return out


def split(blob: bytes) -> tuple[bytes, bytes, bytes]:
    """(prefix + text, payload, trailer) of a valid file."""
    (text_bytes,) = struct.unpack_from("<I", blob, 48)
    (payload_bytes,) = struct.unpack_from("<Q", blob, 40)
    at = 52 + text_bytes
    return blob[:at], blob[at : at + payload_bytes], blob[at + payload_bytes :]


def seed_inputs() -> dict[str, list[bytes]]:
    """Seed inputs per fuzz target (see tests/fuzz/targets.py for what each target reads)."""
    files = seed_checkpoints()
    trailers = [split(b)[2] for b in files if split(b)[2]]
    trailers += [pack_tool_map(tool_entries(1))[:8], b"KTM\x01\x00\x00\x00\x00"]
    # The scan target reads records [selector u8][length u16][file] (see targets.scan_records).
    from .targets import NAME_KINDS, QUARANTINE_LINK, scan_input

    scan = [scan_input([(NAME_KINDS.index("sha1"), b)]) for b in files[:3]]
    scan.append(scan_input([(kind, files[kind % 3]) for kind in range(len(NAME_KINDS))][:4]))
    scan.append(scan_input([(QUARANTINE_LINK, files[0]), (NAME_KINDS.index("symlink_out"), files[4])]))
    return {
        # read_prefix's view: a file of len(input) bytes; payload_bytes 0 so the seeds are valid.
        "prefix": [split(b)[0][:40] + bytes(8) + split(b)[0][48:] for b in files],
        "checkpoint": files,
        "payload": [split(b)[1] for b in files],
        "trailer": trailers,
        "scan": scan,
    }


def write_corpus(root: Path = CORPUS) -> dict[str, int]:
    """Replace the seed files of every target under `root`; returns bytes per target."""
    sizes = {}
    for target, inputs in seed_inputs().items():
        d = root / target
        d.mkdir(parents=True, exist_ok=True)
        for old in d.glob("seed-*"):
            old.unlink()
        for blob in inputs:
            (d / f"seed-{hashlib.sha1(blob).hexdigest()[:16]}").write_bytes(blob)
        sizes[target] = sum(len(b) for b in inputs)
    return sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--root", type=Path, default=CORPUS)
    args = parser.parse_args()
    for target, size in write_corpus(args.root).items():
        print(f"{target}: {size} bytes")


if __name__ == "__main__":
    main()
