"""The DSV4 session payload's layout (spec §3): one function, `compute_layout`, turns a payload
header plus the per-layer row counts into the byte offset and shape of every section.

The reader (`payload`) checks untrusted bytes against it before making any view; the writer
checks caller arrays against it before writing them.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections.abc import Iterator, Sequence
from typing import Any

from .constants import (
    DS4_N_HEAD_DIM,
    DS4_N_INDEXER_HEAD_DIM,
    DS4_N_LAYER,
    DS4_N_SWA,
    DS4_N_VOCAB,
    DS4_PREFILL_CAP,
    F32,
    INDEXED_RATIO,
    MAX_LAYERS,
    PAYLOAD_HEADER_BYTES,
    PAYLOAD_HEADER_FIELDS,
    PAYLOAD_HEADER_WORDS,
    PAYLOAD_MAGIC,
    PAYLOAD_VERSION,
    U32,
    U32_MAX,
    layer_compress_ratio,
    state_coff,
)
from .errors import KvcFormatError

PathLike = str | os.PathLike[str] | None
_WORDS = struct.Struct(f"<{PAYLOAD_HEADER_WORDS}I")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelDims:
    """The model shape a payload records (header words 8-11); ratios follow ds4's layer rule."""

    n_layer: int
    head_dim: int
    index_dim: int
    n_vocab: int

    def ratio(self, layer: int) -> int:
        return layer_compress_ratio(layer)


#: DeepSeek V4 Flash (spec §3.1).
DS4_FLASH = ModelDims(DS4_N_LAYER, DS4_N_HEAD_DIM, DS4_N_INDEXER_HEAD_DIM, DS4_N_VOCAB)


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadHeader:
    """The 13 u32 words at the start of the payload (spec §3.2), in file order."""

    magic: int
    version: int
    ctx_size: int
    prefill_cap: int
    raw_cap: int
    raw_window: int
    comp_cap: int
    n_tokens: int
    n_layer: int
    head_dim: int
    index_dim: int
    n_vocab: int
    raw_live: int

    @classmethod
    def build(
        cls,
        dims: ModelDims,
        *,
        ctx_size: int,
        n_tokens: int,
        raw_window: int | None = None,
        raw_cap: int | None = None,
        prefill_cap: int | None = None,
        comp_cap: int | None = None,
    ) -> PayloadHeader:
        """A header with ds4's CPU-backend values (the files in shared/testdata were written so).

        Defaults: raw_window = raw_cap = min(128, ctx); prefill_cap = 2048 if ctx > 2048 else
        ctx; comp_cap = ctx // 4 + 2; raw_live = min(raw_window, raw_cap, n_tokens). A GPU
        build writes raw_cap 2304; ds4 loaders compare raw_window, not raw_cap, so either loads.
        """
        window = min(DS4_N_SWA, ctx_size) if raw_window is None else raw_window
        cap = window if raw_cap is None else raw_cap
        return cls(
            magic=PAYLOAD_MAGIC,
            version=PAYLOAD_VERSION,
            ctx_size=ctx_size,
            prefill_cap=(DS4_PREFILL_CAP if ctx_size > DS4_PREFILL_CAP else ctx_size)
            if prefill_cap is None
            else prefill_cap,
            raw_cap=cap,
            raw_window=window,
            comp_cap=ctx_size // 4 + 2 if comp_cap is None else comp_cap,
            n_tokens=n_tokens,
            n_layer=dims.n_layer,
            head_dim=dims.head_dim,
            index_dim=dims.index_dim,
            n_vocab=dims.n_vocab,
            raw_live=min(window, cap, n_tokens),
        )

    @property
    def dims(self) -> ModelDims:
        return ModelDims(self.n_layer, self.head_dim, self.index_dim, self.n_vocab)

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in PAYLOAD_HEADER_FIELDS}

    def pack(self) -> bytes:
        values = [getattr(self, name) for name in PAYLOAD_HEADER_FIELDS]
        for name, value in zip(PAYLOAD_HEADER_FIELDS, values, strict=True):
            if not isinstance(value, int) or not 0 <= value <= U32_MAX:
                raise KvcFormatError(None, None, f"payload.{name}", f"{value!r} does not fit a u32")
        return _WORDS.pack(*values)

    @classmethod
    def unpack(cls, buf: Any, offset: int = 0, *, path: PathLike = None) -> PayloadHeader:
        """Parse 52 bytes at `offset` (the caller proved they exist); check magic and version."""
        header = cls(*_WORDS.unpack_from(buf, offset))
        if header.magic != PAYLOAD_MAGIC:
            raise KvcFormatError(
                path, offset, "payload.magic", f"0x{header.magic:08x} is not 0x{PAYLOAD_MAGIC:08x} ('DSV4')"
            )
        if header.version != PAYLOAD_VERSION:
            raise KvcFormatError(
                path, offset + 4, "payload.version", f"{header.version} is not {PAYLOAD_VERSION}"
            )
        return header


@dataclasses.dataclass(frozen=True, slots=True)
class Section:
    """One array in the payload: offset relative to the payload start, shape, element type."""

    name: str
    offset: int
    shape: tuple[int, ...]
    dtype: str = F32

    @property
    def nbytes(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count * 4

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclasses.dataclass(frozen=True, slots=True)
class LayerLayout:
    index: int
    ratio: int
    sections: tuple[Section, ...]

    def section(self, name: str) -> Section | None:
        for sec in self.sections:
            if sec.name == name:
                return sec
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class PayloadLayout:
    """Where every section of one payload sits; `total_bytes` is the exact payload length."""

    header: PayloadHeader
    n_comp: tuple[int, ...]
    n_index_comp: tuple[int, ...]
    tokens: Section
    logits: Section
    n_comp_section: Section
    n_index_comp_section: Section
    layers: tuple[LayerLayout, ...]
    total_bytes: int

    def sections(self) -> Iterator[tuple[int | None, Section]]:
        """Every section in file order, with its layer index (None for the global ones)."""
        for sec in (self.tokens, self.logits, self.n_comp_section, self.n_index_comp_section):
            yield None, sec
        for layer in self.layers:
            for sec in layer.sections:
                yield layer.index, sec


def check_header_dims(h: PayloadHeader, path: PathLike, base: int | None) -> None:
    """Header words that every later size depends on; offsets are absolute when base is known."""

    def at(word: int) -> int | None:
        return None if base is None else base + 4 * word

    if not 1 <= h.n_layer <= MAX_LAYERS:
        raise KvcFormatError(path, at(8), "payload.n_layer", f"{h.n_layer} is outside 1..{MAX_LAYERS}")
    if h.head_dim < 1:
        raise KvcFormatError(path, at(9), "payload.head_dim", "head dim is 0")
    if h.n_layer > 2 and h.index_dim < 1:
        raise KvcFormatError(
            path, at(10), "payload.index_dim", "indexer dim is 0 but the model has ratio-4 layers"
        )
    if h.n_vocab < 1:
        raise KvcFormatError(path, at(11), "payload.n_vocab", "vocab size is 0")
    if h.raw_cap == 0:
        raise KvcFormatError(path, at(4), "payload.raw_cap", "raw ring capacity is 0")
    if h.raw_live != min(h.n_tokens, h.raw_window):
        raise KvcFormatError(
            path,
            at(12),
            "payload.raw_live",
            f"{h.raw_live} != min(n_tokens {h.n_tokens}, raw_window {h.raw_window})",
        )
    if h.raw_live > h.raw_cap:
        raise KvcFormatError(path, at(12), "payload.raw_live", f"{h.raw_live} > raw_cap {h.raw_cap}")


def compute_layout(
    header: PayloadHeader,
    n_comp: Sequence[int],
    n_index_comp: Sequence[int],
    *,
    path: PathLike = None,
    base: int | None = None,
) -> PayloadLayout:
    """Offsets and shapes of every section, after checking the header and counts are coherent.

    `base` is the payload's absolute offset in its file (for error offsets), None for writer input.
    Raises KvcFormatError: n_layer outside 1..MAX_LAYERS, raw_live != min(T, raw_window),
    a count on a layer that has no such section, or a count above comp_cap.
    """
    h = header
    check_header_dims(h, path, base)
    if len(n_comp) != h.n_layer or len(n_index_comp) != h.n_layer:
        raise KvcFormatError(
            path,
            None,
            "payload.n_comp",
            f"{len(n_comp)}/{len(n_index_comp)} counts given for {h.n_layer} layers",
        )
    L, D, Di = h.n_layer, h.head_dim, h.index_dim
    pos = PAYLOAD_HEADER_BYTES
    tokens = Section("tokens", pos, (h.n_tokens,), U32)
    logits = Section("logits", tokens.end, (h.n_vocab,), F32)
    comp_sec = Section("n_comp", logits.end, (L,), U32)
    index_sec = Section("n_index_comp", comp_sec.end, (L,), U32)
    pos = index_sec.end
    layers = []
    for il in range(L):
        ratio = layer_compress_ratio(il)
        c, i = int(n_comp[il]), int(n_index_comp[il])
        for field, value, sec in (("n_comp", c, comp_sec), ("n_index_comp", i, index_sec)):
            where = None if base is None else base + sec.offset + 4 * il
            has_section = ratio != 0 if field == "n_comp" else ratio == INDEXED_RATIO
            if value < 0 or (value and not has_section):
                raise KvcFormatError(
                    path, where, f"payload.{field}[{il}]", f"{value} rows on a ratio-{ratio} layer"
                )
            if value > h.comp_cap:
                raise KvcFormatError(
                    path, where, f"payload.{field}[{il}]", f"{value} > comp_cap {h.comp_cap}"
                )
        secs = [Section("raw", pos, (h.raw_live, D))]
        pos = secs[-1].end
        if ratio:
            coff = state_coff(ratio)
            for name, shape in (
                ("comp", (c, D)),
                ("state_kv", (coff * ratio, coff * D)),
                ("state_score", (coff * ratio, coff * D)),
            ):
                secs.append(Section(name, pos, shape))
                pos = secs[-1].end
        if ratio == INDEXED_RATIO:
            coff = state_coff(ratio)
            state = (coff * ratio, coff * Di)
            for name, shape in (
                ("index_comp", (i, Di)),
                ("index_state_kv", state),
                ("index_state_score", state),
            ):
                secs.append(Section(name, pos, shape))
                pos = secs[-1].end
        layers.append(LayerLayout(il, ratio, tuple(secs)))
    return PayloadLayout(
        header=h,
        n_comp=tuple(int(x) for x in n_comp),
        n_index_comp=tuple(int(x) for x in n_index_comp),
        tokens=tokens,
        logits=logits,
        n_comp_section=comp_sec,
        n_index_comp_section=index_sec,
        layers=tuple(layers),
        total_bytes=pos,
    )


def default_counts(n_layer: int, n_tokens: int) -> tuple[list[int], list[int]]:
    """Row counts in normal operation: n_comp = T // ratio, n_index_comp = T // 4 on ratio-4 layers."""
    n_comp, n_index = [], []
    for il in range(n_layer):
        ratio = layer_compress_ratio(il)
        n_comp.append(n_tokens // ratio if ratio else 0)
        n_index.append(n_tokens // ratio if ratio == INDEXED_RATIO else 0)
    return n_comp, n_index


def payload_size(
    header: PayloadHeader, n_comp: Sequence[int] | None = None, n_index_comp: Sequence[int] | None = None
) -> int:
    """Exact payload length for a header and counts (default: `default_counts`). Allocates nothing."""
    if n_comp is None or n_index_comp is None:
        n_comp, n_index_comp = default_counts(header.n_layer, header.n_tokens)
    return compute_layout(header, n_comp, n_index_comp).total_bytes
