"""Hand-crafted hostile checkpoint files: each a valid tiny file with one field set to a lie.

Every case names the field the reader must blame (`KvcFormatError.field`) and a word of the
message, so tests assert a clear rejection, not just any error.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np

from ds4_vllm.kvc import KvcHeader, SaveReason, ToolMapEntry, checkpoint_name, write_checkpoint

from .seeds import CTX, NANO, NOW, payload_data

TEXT = b"hostile prefix text"
TOKENS = 9
#: KTM entries of the base file: ids with bytes a careless reader might trust.
TOOL_ENTRIES = (
    ToolMapEntry(b"call_\x00nul", b"<invoke a/>"),
    ToolMapEntry(b"../../etc/passwd", b"<invoke b/>"),
)


@dataclasses.dataclass(frozen=True)
class Crafted:
    name: str
    data: bytes
    field: str  # KvcFormatError.field the reader must report
    says: str  # a word the message must contain

    @property
    def file_name(self) -> str:
        """`<sha1(text)>.kv` of the text the file claims (so only the defect itself can reject it)."""
        (n,) = struct.unpack_from("<I", self.data, 48)
        return checkpoint_name(self.data[52 : 52 + n]) if 52 + n <= len(self.data) else checkpoint_name(TEXT)


def base_file(tmp_dir: str, text: bytes = TEXT, tokens: list[int] | None = None) -> bytes:
    """A valid NANO-shaped file of `TOKENS` tokens with the two hostile-id KTM entries."""
    header = KvcHeader.new(quant_bits=2, reason=SaveReason.COLD, tokens=TOKENS, ctx_size=CTX, now=NOW)
    data = payload_data(NANO, TOKENS, 7)
    if tokens is not None:
        data.tokens = np.asarray(tokens, dtype=np.uint32)
    path = write_checkpoint(tmp_dir, text, header, data, TOOL_ENTRIES, fsync=False)
    data = path.read_bytes()
    path.unlink()
    return data


class Layout:
    """Absolute offsets of the fields the cases rewrite."""

    def __init__(self, data: bytes) -> None:
        (self.payload_bytes,) = struct.unpack_from("<Q", data, 40)
        (text_bytes,) = struct.unpack_from("<I", data, 48)
        self.payload = 52 + text_bytes
        self.counts = self.payload + 52 + 4 * TOKENS + 4 * NANO.n_vocab
        self.trailer = self.payload + self.payload_bytes

    def word(self, index: int) -> int:
        return self.payload + 4 * index


def _set(data: bytes, *writes: tuple[str, int, int]) -> bytes:
    buf = bytearray(data)
    for fmt, offset, value in writes:
        struct.pack_into(fmt, buf, offset, value)
    return bytes(buf)


def crafted_files(base: bytes) -> list[Crafted]:
    at = Layout(base)
    u32, u64 = "<I", "<Q"
    tb = at.trailer + 8  # first KTM entry header
    second = tb + 8 + len(TOOL_ENTRIES[0].tool_id) + len(TOOL_ENTRIES[0].dsml)
    T = 7  # payload word of n_tokens
    cases = [
        # lengths that point past the end
        ("text_len_past_end", [(u32, 48, 0xFFFFFFFF)], "text_bytes", "past the end"),
        ("payload_bytes_u64_max", [(u64, 40, 2**64 - 1)], "header.payload_bytes", "past the end"),
        (
            "payload_bytes_one_past",
            [(u64, 40, len(base) - at.payload + 1)],
            "header.payload_bytes",
            "past",
        ),
        (
            "payload_bytes_short",
            [(u64, 40, at.payload_bytes - 4)],
            "payload.layer[2].index_state_score",
            "past the payload end",
        ),
        # counts that would allocate terabytes
        (
            "tokens_16_GiB",
            [(u32, 8, 0xFFFFFFFF), (u32, at.word(T), 0xFFFFFFFF), (u32, at.word(12), CTX)],
            "payload.n_tokens",
            "need",
        ),
        ("logits_16_GiB", [(u32, at.word(11), 0xFFFFFFFF)], "payload.n_vocab", "logits (4294967295)"),
        ("layers_4_billion", [(u32, at.word(8), 0xFFFFFFFF)], "payload.n_layer", "outside"),
        ("layers_4096_in_600_bytes", [(u32, at.word(8), 4096)], "payload.n_layer", "4096 layers"),
        (
            "head_dim_2_billion",
            [(u32, at.word(9), 0x7FFFFFFF)],
            "payload.layer[0].raw",
            "past the payload end",
        ),
        (
            "comp_rows_4_billion",
            [(u32, at.word(6), 0xFFFFFFFF), (u32, at.counts + 8, 0xFFFFFFFF)],
            "payload.layer[2].comp",
            "past the payload end",
        ),
        ("comp_rows_over_cap", [(u32, at.counts + 8, CTX // 4 + 3)], "payload.n_comp[2]", "comp_cap"),
        ("rows_on_a_dense_layer", [(u32, at.counts + 0, 1)], "payload.n_comp[0]", "ratio-0"),
        # dimensions that disagree with each other or with the sections
        ("index_dim_disagrees", [(u32, at.word(10), 2)], "payload.layer[2].index_state_kv", "past"),
        ("head_dim_smaller", [(u32, at.word(9), 1)], "payload", "trailing"),
        ("raw_live_disagrees", [(u32, at.word(12), 3)], "payload.raw_live", "raw_window"),
        ("header_tokens_disagree", [(u32, 8, TOKENS - 1)], "payload.n_tokens", "header says"),
        ("zero_head_dim", [(u32, at.word(9), 0)], "payload.head_dim", "0"),
        # a KTM trailer with hostile counts, ids and sizes
        ("ktm_count_u32_max", [(u32, at.trailer + 4, 0xFFFFFFFF)], "ktm.count", "limit"),
        ("ktm_count_400k_in_60_bytes", [(u32, at.trailer + 4, 400_000)], "ktm.count", "cannot fit"),
        ("ktm_id_len_zero", [(u32, tb, 0)], "ktm.entry[0].id_len", "outside 1..256"),
        ("ktm_id_len_257", [(u32, tb, 257)], "ktm.entry[0].id_len", "outside 1..256"),
        ("ktm_id_len_u32_max", [(u32, tb, 0xFFFFFFFF)], "ktm.entry[0].id_len", "outside"),
        ("ktm_dsml_len_u32_max", [(u32, tb + 4, 0xFFFFFFFF)], "ktm.entry[0].dsml_len", "outside"),
        ("ktm_dsml_512_MiB_past_end", [(u32, tb + 4, 512 * 1024 * 1024)], "ktm.entry[0]", "past the end"),
        ("ktm_second_entry_past_end", [(u32, second + 4, 1 << 20)], "ktm.entry[1]", "past the end"),
    ]
    return [Crafted(name, _set(base, *writes), field, says) for name, writes, field, says in cases]
