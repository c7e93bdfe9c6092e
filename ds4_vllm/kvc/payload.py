"""The DSV4 session payload (spec §3): read as views over a buffer, written streamed a layer at a
time, both checked against `payload_layout.compute_layout`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from .constants import (
    F32,
    LAYER_SECTIONS,
    PAYLOAD_HEADER_BYTES,
    U32,
    U32_MAX,
)
from .errors import KvcFormatError
from .payload_layout import (
    PathLike,
    PayloadHeader,
    PayloadLayout,
    Section,
    check_header_dims,
    compute_layout,
)

# ---------------------------------------------------------------------------
# Arrays in and out
# ---------------------------------------------------------------------------


@dataclasses.dataclass(slots=True)
class LayerArrays:
    """The arrays of one layer. Sections a layer does not have (by its ratio) are None.

    Shapes (R raw_live, D head dim, Di indexer dim, c/i row counts, coff 2 on ratio 4 else 1):
    raw [R, D]; comp [c, D]; state_kv / state_score [coff*ratio, coff*D];
    index_comp [i, Di]; index_state_kv / index_state_score [8, 2*Di]. All float32.
    """

    raw: Any
    comp: Any = None
    state_kv: Any = None
    state_score: Any = None
    index_comp: Any = None
    index_state_kv: Any = None
    index_state_score: Any = None


LayerSource = Iterable[LayerArrays | Mapping[str, Any]] | Callable[[int], LayerArrays | Mapping[str, Any]]


class PayloadLike(Protocol):
    """What `write_payload` needs: a `PayloadData` to write new state, or a read `Payload` to copy."""

    header: PayloadHeader
    tokens: Any
    logits: Any
    n_comp: Sequence[int]
    n_index_comp: Sequence[int]
    layers: Any


@dataclasses.dataclass(slots=True)
class PayloadData:
    """Input of the writer. `layers` is a sequence/iterator of per-layer arrays, or a callable
    `layer_index -> LayerArrays` called once per layer in order, so the caller can produce
    (e.g. copy off a device) one layer at a time while the writer streams it out."""

    header: PayloadHeader
    tokens: Any
    logits: Any
    n_comp: Sequence[int]
    n_index_comp: Sequence[int]
    layers: LayerSource


@dataclasses.dataclass(slots=True)
class Payload:
    """A parsed payload: read-only numpy views into the file's memory map (no copies).

    Views are not guaranteed to be 4-byte aligned (the text before the payload has any
    length); numpy handles that, and copying into an aligned tensor is the caller's choice.
    """

    header: PayloadHeader
    layout: PayloadLayout
    tokens: np.ndarray
    logits: np.ndarray
    n_comp: tuple[int, ...]
    n_index_comp: tuple[int, ...]
    layers: tuple[LayerArrays, ...]

    def layer(self, index: int) -> LayerArrays:
        return self.layers[index]


def _view(buf: Any, base: int, sec: Section) -> np.ndarray:
    count = sec.nbytes // 4
    return np.frombuffer(buf, dtype=sec.dtype, count=count, offset=base + sec.offset).reshape(sec.shape)


def parse_payload(buf: Any, base: int, length: int, *, path: PathLike = None) -> Payload:
    """Validate the payload at `buf[base:base+length]` and map every section as a view.

    The caller has proved `base + length <= len(buf)`. Every count is checked against
    `length` before it is used; nothing is copied or allocated in proportion to the file.
    """
    if length < PAYLOAD_HEADER_BYTES:
        raise KvcFormatError(
            path, base, "payload.header", f"payload of {length} bytes is shorter than its 52-byte header"
        )
    header = PayloadHeader.unpack(buf, base, path=path)
    check_header_dims(header, path, base)
    # Prove the fixed-size sections fit before reading the per-layer counts out of them.
    fixed = PAYLOAD_HEADER_BYTES + 4 * header.n_tokens + 4 * header.n_vocab + 8 * header.n_layer
    if fixed > length:
        # Blame the word whose section is largest: that is the lie (offsets: words 7, 11, 8).
        word, name = max(
            ((7, "n_tokens"), (11, "n_vocab"), (8, "n_layer")),
            key=lambda w: {7: 4 * header.n_tokens, 11: 4 * header.n_vocab, 8: 8 * header.n_layer}[w[0]],
        )
        raise KvcFormatError(
            path,
            base + 4 * word,
            f"payload.{name}",
            f"tokens ({header.n_tokens}), logits ({header.n_vocab}) and counts ({header.n_layer} layers) "
            f"need {fixed} bytes but the payload has {length}",
        )
    counts_at = PAYLOAD_HEADER_BYTES + 4 * header.n_tokens + 4 * header.n_vocab
    n_comp = np.frombuffer(buf, dtype=U32, count=header.n_layer, offset=base + counts_at).tolist()
    n_index = np.frombuffer(
        buf, dtype=U32, count=header.n_layer, offset=base + counts_at + 4 * header.n_layer
    ).tolist()
    layout = compute_layout(header, n_comp, n_index, path=path, base=base)
    for layer_index, sec in layout.sections():
        if sec.end > length:
            where = "" if layer_index is None else f"layer[{layer_index}]."
            raise KvcFormatError(
                path,
                base + sec.offset,
                f"payload.{where}{sec.name}",
                f"section of shape {sec.shape} ends {sec.end - length} bytes past the payload end (byte {base + length})",
            )
    if layout.total_bytes != length:
        raise KvcFormatError(
            path,
            base + layout.total_bytes,
            "payload",
            f"{length - layout.total_bytes} trailing payload bytes (payload_bytes {length}, sections end at {layout.total_bytes})",
        )
    layers = tuple(
        LayerArrays(**{sec.name: _view(buf, base, sec) for sec in lay.sections}) for lay in layout.layers
    )
    return Payload(
        header=header,
        layout=layout,
        tokens=_view(buf, base, layout.tokens),
        logits=_view(buf, base, layout.logits),
        n_comp=layout.n_comp,
        n_index_comp=layout.n_index_comp,
        layers=layers,
    )


def _as_layer(obj: LayerArrays | Mapping[str, Any], index: int) -> LayerArrays:
    if isinstance(obj, LayerArrays):
        return obj
    if isinstance(obj, Mapping):
        unknown = set(obj) - set(LAYER_SECTIONS)
        if unknown:
            raise KvcFormatError(None, None, f"layer[{index}]", f"unknown sections {sorted(unknown)}")
        return LayerArrays(**obj)
    raise KvcFormatError(
        None, None, f"layer[{index}]", f"expected LayerArrays or a mapping, got {type(obj).__name__}"
    )


def _iter_layers(source: Any, n_layer: int) -> Iterator[LayerArrays]:
    if callable(source):
        for il in range(n_layer):
            yield _as_layer(source(il), il)
        return
    count = 0
    for count, obj in enumerate(source, start=1):  # noqa: B007 - count is read after the loop
        if count > n_layer:
            raise KvcFormatError(None, None, "layers", f"more than {n_layer} layers given")
        yield _as_layer(obj, count - 1)
    if count != n_layer:
        raise KvcFormatError(None, None, "layers", f"{count} layers given, the header says {n_layer}")


def _checked_array(value: Any, shape: tuple[int, ...], dtype: str, field: str) -> np.ndarray:
    if value is None:
        raise KvcFormatError(None, None, field, f"missing; expected shape {shape}")
    arr = np.asarray(value)
    if arr.shape != shape:
        raise KvcFormatError(None, None, field, f"shape {arr.shape} != expected {shape}")
    if dtype == U32:
        if arr.size and arr.dtype.kind not in "ui":
            raise KvcFormatError(None, None, field, f"dtype {arr.dtype} is not an integer type")
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > U32_MAX):
            raise KvcFormatError(None, None, field, "values do not fit u32")
    elif arr.dtype.kind not in "fiub":
        raise KvcFormatError(None, None, field, f"dtype {arr.dtype} is not numeric")
    return np.ascontiguousarray(arr, dtype=dtype)


def write_payload(write: Callable[[Any], Any], data: PayloadLike) -> int:
    """Stream a payload through `write` (e.g. a file's write), one section at a time.

    Peak extra memory is one layer's arrays (only when they need a dtype conversion);
    the whole payload is never concatenated. Returns the number of bytes written, which
    equals `payload_size(data.header, data.n_comp, data.n_index_comp)`.
    Raises KvcFormatError for inconsistent shapes, counts or header fields.
    """
    header = data.header
    n_comp = [int(x) for x in data.n_comp]
    n_index = [int(x) for x in data.n_index_comp]
    layout = compute_layout(header, n_comp, n_index)
    written = 0

    def emit(arr: np.ndarray) -> None:
        nonlocal written
        if arr.size:
            write(memoryview(arr.reshape(-1).view(np.uint8).data))
            written += arr.nbytes

    write(header.pack())
    written += PAYLOAD_HEADER_BYTES
    emit(_checked_array(data.tokens, layout.tokens.shape, U32, "tokens"))
    emit(_checked_array(data.logits, layout.logits.shape, F32, "logits"))
    emit(np.asarray(n_comp, dtype=U32))
    emit(np.asarray(n_index, dtype=U32))
    layer_iter = _iter_layers(data.layers, header.n_layer)
    for lay, arrays in zip(layout.layers, layer_iter, strict=False):
        present = {sec.name for sec in lay.sections}
        for name in LAYER_SECTIONS:
            value = getattr(arrays, name)
            if name not in present and value is not None and np.asarray(value).size:
                raise KvcFormatError(
                    None,
                    None,
                    f"layer[{lay.index}].{name}",
                    f"a ratio-{lay.ratio} layer has no {name} section",
                )
        for sec in lay.sections:
            emit(_checked_array(getattr(arrays, sec.name), sec.shape, F32, f"layer[{lay.index}].{sec.name}"))
    for _ in layer_iter:  # runs the generator's end check: too many layers raise there
        pass
    if written != layout.total_bytes:  # pragma: no cover - guarded by the shape checks above
        raise KvcFormatError(
            None, None, "payload", f"wrote {written} bytes, layout says {layout.total_bytes}"
        )
    return written
