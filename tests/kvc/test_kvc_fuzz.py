"""Mutated and truncated files: the reader either succeeds or raises KvcFormatError, never
anything else, never hangs, never reads outside the buffer."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from ds4_vllm.cli.kv import verify_file
from ds4_vllm.kvc import CheckpointIndex, KvcFormatError, open_checkpoint, parse_checkpoint, read_prefix
from ds4_vllm.kvc.payload_layout import compute_layout
from tests.kvc.kvc_helpers import MICRO, new_header, random_payload, tool_entries

pytestmark = pytest.mark.reliability

INTERESTING_U32 = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    127,
    128,
    129,
    255,
    256,
    4096,
    0x7FFFFFFF,
    0x80000000,
    0xFFFFFFFE,
    0xFFFFFFFF,
]


def seeds(tmp: Path) -> list[bytes]:
    from ds4_vllm.kvc import write_checkpoint

    out = []
    for n_tokens, tools, text in (
        (3, 0, b"a"),
        (130, 2, b"hello world"),
        (9, 1, b""),
        (257, 0, "ü".encode() * 5),
    ):
        data = random_payload(MICRO, n_tokens, np.random.default_rng(n_tokens), ctx_size=1024)
        path = write_checkpoint(
            tmp, text, new_header(n_tokens, ctx_size=1024), data, tool_entries(tools), fsync=False
        )
        out.append(path.read_bytes())
        path.unlink()
    return out


def field_offsets(blob: bytes) -> list[int]:
    """Offsets of every u32 that drives a length: header, payload header, counts, KTM."""
    text_bytes = struct.unpack_from("<I", blob, 48)[0]
    payload_at = 52 + text_bytes
    payload_bytes = struct.unpack_from("<Q", blob, 40)[0]
    offsets = [8, 12, 16, 40, 44, 48]
    offsets += [payload_at + 4 * i for i in range(13)]
    n_tokens, n_layer, n_vocab = (struct.unpack_from("<I", blob, payload_at + 4 * i)[0] for i in (7, 8, 11))
    counts_at = payload_at + 52 + 4 * n_tokens + 4 * n_vocab
    offsets += [counts_at + 4 * i for i in range(2 * n_layer)]
    trailer = payload_at + payload_bytes
    if trailer + 8 <= len(blob):
        offsets += [trailer, trailer + 4, trailer + 8, trailer + 12]
    return offsets


def boundaries(blob: bytes) -> list[int]:
    text_bytes = struct.unpack_from("<I", blob, 48)[0]
    payload_at = 52 + text_bytes
    with parse_checkpoint(blob) as ck:
        layout = ck.payload.layout
        cuts = {0, 1, 47, 48, 51, 52, payload_at, len(blob) - 1}
        for _, sec in layout.sections():
            cuts |= {payload_at + sec.offset, payload_at + sec.end - 1}
        assert (
            compute_layout(layout.header, layout.n_comp, layout.n_index_comp).total_bytes
            == ck.header.payload_bytes
        )
    return sorted(c for c in cuts if 0 <= c < len(blob))


def exercise(blob: bytes) -> None:
    """Everything a consumer does with a checkpoint; only KvcFormatError may escape."""
    for strict in (True, False):
        try:
            ck = parse_checkpoint(blob, strict_trailer=strict)
        except KvcFormatError as exc:
            assert exc.offset is None or 0 <= exc.offset <= max(len(blob), 2**64), exc
            str(exc)
            continue
        with ck:
            p = ck.payload
            assert len(p.layers) == p.header.n_layer
            for lay in p.layers:
                for arr in (lay.raw, lay.comp, lay.state_kv, lay.index_comp, lay.index_state_score):
                    if arr is not None and arr.size:
                        float(arr.reshape(-1)[-1])
            int(p.tokens[-1]) if p.tokens.size else None
            for entry in ck.tool_map.entries:
                assert 1 <= len(entry.tool_id) <= 256


def mutations(blob: bytes, rng: random.Random, n: int):
    fields = field_offsets(blob)
    for _ in range(n):
        buf = bytearray(blob)
        kind = rng.randrange(5)
        if kind == 0:  # random bit flips
            for _ in range(rng.randint(1, 4)):
                i = rng.randrange(len(buf))
                buf[i] ^= 1 << rng.randrange(8)
        elif kind == 1:  # a length/count field set to an edge value
            off = rng.choice(fields)
            if off + 4 <= len(buf):
                struct.pack_into("<I", buf, off, rng.choice(INTERESTING_U32 + [len(blob), len(blob) - off]))
        elif kind == 2:  # u64 payload length anywhere in its range
            struct.pack_into(
                "<Q", buf, 40, rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(2 * len(blob))])
            )
        elif kind == 3:  # truncation
            del buf[rng.randrange(len(buf)) :]
        else:  # appended junk, or a random byte overwrite within the first 200 bytes
            if rng.random() < 0.5:
                buf += bytes(rng.randrange(256) for _ in range(rng.randint(1, 40)))
            else:
                buf[rng.randrange(min(200, len(buf)))] = rng.randrange(256)
        yield bytes(buf)


@pytest.mark.timeout(120)
def test_fuzz_mutations_and_truncations(tmp_path: Path) -> None:
    rng = random.Random(20261130)
    corpus = seeds(tmp_path)
    cases = 0
    for blob in corpus:
        exercise(blob)  # the seeds themselves are valid
        for cut in boundaries(blob):
            for cut_at in (cut, cut + 1):
                exercise(blob[:cut_at])
                cases += 1
        for mutated in mutations(blob, rng, 2000):
            exercise(mutated)
            cases += 1
    assert cases > 4000


@pytest.mark.timeout(120)
def test_fuzz_through_files_index_and_verify(tmp_path: Path) -> None:
    """The file-level entry points (mmap open, prefix read, scan, verify) on hostile files."""
    rng = random.Random(7)
    corpus = seeds(tmp_path)
    d = tmp_path / "cache"
    d.mkdir()
    for i, mutated in enumerate(m for blob in corpus for m in mutations(blob, rng, 60)):
        path = d / f"{i:040x}.kv"
        path.write_bytes(mutated)
        for call in (open_checkpoint, read_prefix):
            try:
                result = call(path) if call is read_prefix else call(path, check_name=False)
            except KvcFormatError:
                continue
            if call is open_checkpoint:
                result.close()
        reason = verify_file(path)
        assert reason is None or isinstance(reason, str)
    (d / "empty.kv").write_bytes(b"")
    (d / ("f" * 40 + ".kv")).write_bytes(b"")
    idx = CheckpointIndex(d)
    idx.refresh()
    assert len(idx) + len(idx.invalid) == 241
    for entry in idx.entries:
        idx.lookup(entry.text or b"")
