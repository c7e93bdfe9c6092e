"""Typed access to a GGUF file's metadata keys, and the embedded `tokenizer.ggml.*` vocabulary.

`GgufMetadata` reads one key as the type the caller needs and raises `Ds4GgufError` naming the key
when it is missing or of another type; `_BoundsCheckedReader` turns gguf's unchecked slicing of a
short file into an error naming the byte offset or tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GgmlType
from gguf import GGUFValueType


class Ds4GgufError(ValueError):
    """A file that is not a usable ds4 DeepSeek V4 GGUF; the message names the key/tensor/offset."""


class BoundsCheckedReader(gguf.GGUFReader):
    """`GGUFReader` that reports a truncated file instead of failing on an obscure reshape.

    gguf 0.19 slices its memmap without bounds checks: a short file gives short arrays, which later
    fail to reshape. The two overrides below turn that into errors naming the byte offset (header)
    or the tensor (data).
    """

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        arr = super()._get(offset, dtype, count, override_order)
        if arr.shape[0] < int(count):
            raise Ds4GgufError(
                f"file is truncated: its header needs {int(count)} x {np.dtype(dtype).name} at byte offset "
                f"{offset}, but the file ends at byte {self.data.size}"
            )
        return arr

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        size = int(self.data.size)
        for field in fields:
            _name_len, name_data, _n_dims, dims, raw_dtype, offset_tensor = field.parts
            name = bytes(name_data).decode("utf-8", errors="replace")
            try:
                ggml_type = GgmlType(int(raw_dtype[0]))
            except ValueError:
                raise Ds4GgufError(f"tensor {name}: unknown GGML type id {int(raw_dtype[0])}") from None
            block, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
            n_elems = math.prod(int(x) for x in dims)
            if int(dims[0]) % block:
                raise Ds4GgufError(
                    f"tensor {name}: innermost dim {int(dims[0])} is not a multiple of the "
                    f"{ggml_type.name} block size {block}"
                )
            start = start_offs + int(offset_tensor[0])
            end = start + n_elems // block * type_size
            if end > size:
                raise Ds4GgufError(
                    f"file is truncated: tensor {name} ({ggml_type.name}) occupies bytes {start}..{end}, "
                    f"but the file ends at byte {size}"
                )
        super()._build_tensors(start_offs, fields)


INT_TYPES = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


def shortest_float(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


class GgufMetadata:
    """The metadata keys of an opened GGUF, read with the type each caller expects."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self.fields = reader.fields

    def keys(self) -> list[str]:
        return [k for k in self.fields if not k.startswith("GGUF.")]

    def field(self, key: str) -> Any:
        return self.fields.get(key)

    def value(self, key: str, kinds: set[GGUFValueType], what: str, required: bool = True) -> Any:
        field = self.field(key)
        if field is None:
            if required:
                raise Ds4GgufError(f"required metadata key {key} is missing")
            return None
        if field.types[0] not in kinds:
            raise Ds4GgufError(f"metadata key {key} has type {field.types[0].name}, expected {what}")
        return field.contents()

    def get_int(self, key: str, required: bool = True) -> int | None:
        value = self.value(key, INT_TYPES, "an integer", required)
        if value is not None and value < 0:
            raise Ds4GgufError(f"metadata key {key} = {value} must not be negative")
        return None if value is None else int(value)

    def get_float(self, key: str, required: bool = True) -> float | None:
        value = self.value(key, FLOAT_TYPES, "a float", required)
        if value is None:
            return None
        return shortest_float(value) if self.field(key).types[0] == GGUFValueType.FLOAT32 else float(value)

    def get_bool(self, key: str, required: bool = True) -> bool | None:
        return self.value(key, {GGUFValueType.BOOL}, "a bool", required)

    def get_str(self, key: str, required: bool = True) -> str | None:
        return self.value(key, {GGUFValueType.STRING}, "a string", required)

    def get_array(
        self, key: str, item_kinds: set[GGUFValueType], what: str, required: bool = True
    ) -> list | None:
        field = self.field(key)
        if field is None:
            if required:
                raise Ds4GgufError(f"required metadata key {key} is missing")
            return None
        if field.types[0] != GGUFValueType.ARRAY or (
            len(field.types) > 1 and field.types[1] not in item_kinds
        ):
            got = "/".join(t.name for t in field.types)
            raise Ds4GgufError(f"metadata key {key} has type {got}, expected an array of {what}")
        return list(field.contents())


@dataclass(frozen=True)
class GgufTokenizerMetadata:
    """The `tokenizer.ggml.*` vocabulary a GGUF embeds (llama.cpp's key names).

    `token_types` uses llama.cpp's codes (1 normal, 3 control, 4 user-defined, ...) and is None
    when the file has none (the ds4 test files do not write it).
    """

    model: str  # tokenizer.ggml.model, "gpt2" = byte-level BPE
    pre: str | None  # tokenizer.ggml.pre, the pre-tokenizer's name ("joyai-llm" for DeepSeek V4)
    tokens: list[str]
    merges: list[str]
    token_types: list[int] | None
    bos_token_id: int | None
    eos_token_id: int | None
    padding_token_id: int | None
    chat_template: str | None


def read_tokenizer_metadata(meta: GgufMetadata, path: Path) -> GgufTokenizerMetadata | None:
    """The embedded vocabulary, or None when the file carries no `tokenizer.ggml.tokens`."""
    if meta.field("tokenizer.ggml.tokens") is None:
        return None
    strings = {GGUFValueType.STRING}
    tokens = meta.get_array("tokenizer.ggml.tokens", strings, "strings")
    merges = meta.get_array("tokenizer.ggml.merges", strings, "strings", required=False) or []
    types = meta.get_array("tokenizer.ggml.token_type", INT_TYPES, "integers", required=False)
    if types is not None and len(types) != len(tokens or []):
        raise Ds4GgufError(
            f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens or [])} tokens"
        )
    return GgufTokenizerMetadata(
        model=meta.get_str("tokenizer.ggml.model") or "",
        pre=meta.get_str("tokenizer.ggml.pre", required=False),
        tokens=list(tokens or []),
        merges=list(merges),
        token_types=None if types is None else [int(x) for x in types],
        bos_token_id=meta.get_int("tokenizer.ggml.bos_token_id", required=False),
        eos_token_id=meta.get_int("tokenizer.ggml.eos_token_id", required=False),
        padding_token_id=meta.get_int("tokenizer.ggml.padding_token_id", required=False),
        chat_template=meta.get_str("tokenizer.chat_template", required=False),
    )
