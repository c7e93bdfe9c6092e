"""Reading the ds4 engine's DeepSeek V4 Flash GGUF files (`general.architecture = deepseek4`).

`Ds4GgufFile.open(path)` memory-maps the file with `gguf.GGUFReader`, checks every `deepseek4.*`
key the model needs and every tensor's name, type, shape and byte range against those keys, and
fails fast with a `Ds4GgufError` naming the key, tensor or byte offset at fault. Afterwards:

- `config()` is the model's `Ds4Config`;
- `tensors()` yields the weights under DeepSeek's native checkpoint names (`embed.weight`,
  `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.w1`, ...), as zero-copy views over the map:
  F16/F32 tensors as torch tensors, block-quantized ones as `QuantizedWeight`;
- `expert_quant_bits()` says whether the routed experts are the 2-bit or the 4-bit recipe;
- `tokenizer_metadata()` returns the embedded `tokenizer.ggml.*` vocabulary.

The layout is ds4's (`weights_bind` / `weights_validate_layout` in `ds4.c`), but the widths come
from the file's metadata instead of the engine's compiled-in Flash constants, so small test models
in the same layout open too. Only tensors ds4 reads are checked and handed out; `mtp.*` (the
separate speculative-decoding file) and any other extra tensors are ignored.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as GgmlType
from gguf import GGUFValueType

from ds4_vllm.model.config import (
    DS4_ARCHITECTURE,
    RATIO_TO_LAYER_TYPE,
    Ds4Config,
    ds4_compress_ratio,
)
from ds4_vllm.model.quant import QuantizedWeight, QuantType

GGUF_ARCHITECTURE = "deepseek4"
KEY_PREFIX = "deepseek4."


class Ds4GgufError(ValueError):
    """A file that is not a usable ds4 DeepSeek V4 GGUF; the message names the key/tensor/offset."""


# ---------------------------------------------------------------------------------------------
# Dimensions and the tensor layout they imply
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ds4GgufDims:
    """The widths a ds4-layout file is built from (one `deepseek4.*` key each)."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    n_out_group: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_hash_layer: int
    indexer_heads: int
    indexer_head_dim: int
    n_hc: int

    @property
    def compress_ratios(self) -> list[int]:
        return [ds4_compress_ratio(i) for i in range(self.n_layer)]

    @classmethod
    def from_config(cls, config: Ds4Config) -> Ds4GgufDims:
        return cls(
            n_layer=config.num_hidden_layers,
            n_embd=config.hidden_size,
            n_vocab=config.vocab_size,
            n_head=config.num_attention_heads,
            head_dim=config.head_dim,
            n_rot=config.rope_dim,
            q_lora_rank=config.q_lora_rank,
            o_lora_rank=config.o_lora_rank,
            n_out_group=config.o_groups,
            n_expert=config.n_routed_experts,
            n_expert_used=config.num_experts_per_tok,
            n_ff_exp=config.moe_intermediate_size,
            n_hash_layer=list(config.mlp_layer_types).count("hash_moe"),
            indexer_heads=config.index_n_heads,
            indexer_head_dim=config.index_head_dim,
            n_hc=config.hc_mult,
        )


# Routed-expert block formats ds4 runs, and the recipe each one belongs to.
EXPERT_TYPE_BITS: dict[GgmlType, int] = {GgmlType.IQ2_XXS: 2, GgmlType.Q2_K: 2, GgmlType.Q4_K: 4}
EXPERT_TYPES = tuple(EXPERT_TYPE_BITS)

GGML_TO_QUANT_TYPE: dict[GgmlType, QuantType] = {
    GgmlType.Q8_0: QuantType.Q8_0,
    GgmlType.Q2_K: QuantType.Q2_K,
    GgmlType.Q4_K: QuantType.Q4_K,
    GgmlType.IQ2_XXS: QuantType.IQ2_XXS,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the ds4 layout: its GGUF name, native DeepSeek name, torch shape, and types."""

    gguf_name: str
    native_name: str
    shape: tuple[int, ...]  # torch order ([..., out, in]); GGUF lists the dims reversed
    types: tuple[GgmlType, ...]  # the types ds4 accepts; the first is what the real files use
    optional: bool = False


def ds4_tensor_layout(dims: Ds4GgufDims) -> list[TensorSpec]:
    """Every tensor ds4 binds, in file order (`weights_bind`/`weights_validate_layout` in ds4.c).

    Types are ds4's: Q8_0 for attention, shared experts and the LM head; F16 for the embedding,
    HC mixers, router, compressors and indexer; F32 for norms, HC base/scale, sinks and the router
    bias; I32 for the hash-routing table; IQ2_XXS/Q2_K/Q4_K for routed experts.
    """
    d = dims
    hc_dim = d.n_hc * d.n_embd
    hc_mix = 2 * d.n_hc + d.n_hc * d.n_hc
    f16, f32, q8, i32 = (GgmlType.F16,), (GgmlType.F32,), (GgmlType.Q8_0,), (GgmlType.I32,)
    specs = [
        TensorSpec("token_embd.weight", "embed.weight", (d.n_vocab, d.n_embd), f16),
        TensorSpec("output.weight", "head.weight", (d.n_vocab, d.n_embd), q8),
        TensorSpec("output_norm.weight", "norm.weight", (d.n_embd,), f32),
        TensorSpec("output_hc_fn.weight", "hc_head_fn", (d.n_hc, hc_dim), f16),
        TensorSpec("output_hc_base.weight", "hc_head_base", (d.n_hc,), f32),
        TensorSpec("output_hc_scale.weight", "hc_head_scale", (1,), f32),
    ]
    group_in = d.head_dim * (d.n_head // max(d.n_out_group, 1))
    for il, ratio in enumerate(d.compress_ratios):
        b, n, a = f"blk.{il}.", f"layers.{il}.", f"layers.{il}.attn."
        for part in ("attn", "ffn"):
            specs += [
                TensorSpec(f"{b}hc_{part}_fn.weight", f"{n}hc_{part}_fn", (hc_mix, hc_dim), f16),
                TensorSpec(f"{b}hc_{part}_scale.weight", f"{n}hc_{part}_scale", (3,), f32),
                TensorSpec(f"{b}hc_{part}_base.weight", f"{n}hc_{part}_base", (hc_mix,), f32),
            ]
        specs += [
            TensorSpec(f"{b}attn_norm.weight", f"{n}attn_norm.weight", (d.n_embd,), f32),
            TensorSpec(f"{b}attn_q_a.weight", f"{a}wq_a.weight", (d.q_lora_rank, d.n_embd), q8),
            TensorSpec(f"{b}attn_q_a_norm.weight", f"{a}q_norm.weight", (d.q_lora_rank,), f32),
            TensorSpec(f"{b}attn_q_b.weight", f"{a}wq_b.weight", (d.n_head * d.head_dim, d.q_lora_rank), q8),
            TensorSpec(f"{b}attn_kv.weight", f"{a}wkv.weight", (d.head_dim, d.n_embd), q8),
            TensorSpec(f"{b}attn_kv_a_norm.weight", f"{a}kv_norm.weight", (d.head_dim,), f32),
            TensorSpec(f"{b}attn_sinks.weight", f"{a}attn_sink", (d.n_head,), f32),
            TensorSpec(
                f"{b}attn_output_a.weight", f"{a}wo_a.weight", (d.n_out_group * d.o_lora_rank, group_in), q8
            ),
            TensorSpec(
                f"{b}attn_output_b.weight", f"{a}wo_b.weight", (d.n_embd, d.n_out_group * d.o_lora_rank), q8
            ),
        ]
        if ratio:
            width = (2 if ratio == 4 else 1) * d.head_dim  # ratio 4 pools overlapping windows
            c = f"{a}compressor."
            specs += [
                TensorSpec(f"{b}attn_compressor_ape.weight", f"{c}ape", (ratio, width), f16),
                TensorSpec(f"{b}attn_compressor_kv.weight", f"{c}wkv.weight", (width, d.n_embd), f16),
                TensorSpec(f"{b}attn_compressor_gate.weight", f"{c}wgate.weight", (width, d.n_embd), f16),
                TensorSpec(f"{b}attn_compressor_norm.weight", f"{c}norm.weight", (d.head_dim,), f32),
            ]
        if ratio == 4:
            x, ic = f"{a}indexer.", f"{a}indexer.compressor."
            iw = 2 * d.indexer_head_dim
            specs += [
                TensorSpec(
                    f"{b}indexer.attn_q_b.weight",
                    f"{x}wq_b.weight",
                    (d.indexer_heads * d.indexer_head_dim, d.q_lora_rank),
                    f16,
                ),
                TensorSpec(
                    f"{b}indexer.proj.weight", f"{x}weights_proj.weight", (d.indexer_heads, d.n_embd), f16
                ),
                TensorSpec(f"{b}indexer_compressor_ape.weight", f"{ic}ape", (ratio, iw), f16),
                TensorSpec(f"{b}indexer_compressor_kv.weight", f"{ic}wkv.weight", (iw, d.n_embd), f16),
                TensorSpec(f"{b}indexer_compressor_gate.weight", f"{ic}wgate.weight", (iw, d.n_embd), f16),
                TensorSpec(
                    f"{b}indexer_compressor_norm.weight", f"{ic}norm.weight", (d.indexer_head_dim,), f32
                ),
            ]
        f = f"{n}ffn."
        hash_layer = il < d.n_hash_layer
        specs += [
            TensorSpec(f"{b}ffn_norm.weight", f"{n}ffn_norm.weight", (d.n_embd,), f32),
            TensorSpec(f"{b}ffn_gate_inp.weight", f"{f}gate.weight", (d.n_expert, d.n_embd), f16),
        ]
        if not hash_layer:
            # ds4 treats a missing bias as zeros (`tensor_by_namef`); `tensors()` yields zeros then.
            specs.append(
                TensorSpec(f"{b}exp_probs_b.bias", f"{f}gate.bias", (d.n_expert,), f32, optional=True)
            )
        specs += [
            TensorSpec(
                f"{b}ffn_gate_exps.weight", f"{f}experts.w1", (d.n_expert, d.n_ff_exp, d.n_embd), EXPERT_TYPES
            ),
            TensorSpec(
                f"{b}ffn_up_exps.weight", f"{f}experts.w3", (d.n_expert, d.n_ff_exp, d.n_embd), EXPERT_TYPES
            ),
            TensorSpec(
                f"{b}ffn_down_exps.weight", f"{f}experts.w2", (d.n_expert, d.n_embd, d.n_ff_exp), EXPERT_TYPES
            ),
            TensorSpec(
                f"{b}ffn_gate_shexp.weight", f"{f}shared_experts.w1.weight", (d.n_ff_exp, d.n_embd), q8
            ),
            TensorSpec(f"{b}ffn_up_shexp.weight", f"{f}shared_experts.w3.weight", (d.n_ff_exp, d.n_embd), q8),
            TensorSpec(
                f"{b}ffn_down_shexp.weight", f"{f}shared_experts.w2.weight", (d.n_embd, d.n_ff_exp), q8
            ),
        ]
        if hash_layer:
            specs.append(
                TensorSpec(
                    f"{b}ffn_gate_tid2eid.weight", f"{f}gate.tid2eid", (d.n_vocab, d.n_expert_used), i32
                )
            )
    return specs


# ---------------------------------------------------------------------------------------------
# The reader
# ---------------------------------------------------------------------------------------------


class _BoundsCheckedReader(gguf.GGUFReader):
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


_INT_TYPES = {
    GGUFValueType.UINT8,
    GGUFValueType.INT8,
    GGUFValueType.UINT16,
    GGUFValueType.INT16,
    GGUFValueType.UINT32,
    GGUFValueType.INT32,
    GGUFValueType.UINT64,
    GGUFValueType.INT64,
}
_FLOAT_TYPES = {GGUFValueType.FLOAT32, GGUFValueType.FLOAT64}


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


class Ds4GgufFile:
    """An opened, validated ds4 GGUF. Build with `Ds4GgufFile.open(path)`."""

    def __init__(self, path: Path, reader: gguf.GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self._tensors = {t.name: t for t in reader.tensors}
        self.dims = self._read_dims()
        self.layout = ds4_tensor_layout(self.dims)
        self._check_tensors()
        self._config = self._build_config()

    # -- opening -------------------------------------------------------------------------------

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> Ds4GgufFile:
        """Memory-map and validate `path`; raise `Ds4GgufError` (message starts with the path)."""
        path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise Ds4GgufError(f"{path}: cannot open: {exc.strerror}") from exc
        try:
            if size < 24:  # magic, version, tensor count, kv count
                raise Ds4GgufError(
                    f"file is truncated: {size} bytes is shorter than a GGUF header (24 bytes)"
                )
            try:
                reader = _BoundsCheckedReader(path, "r")
            except Ds4GgufError:
                raise
            except (ValueError, KeyError, UnicodeDecodeError) as exc:
                raise Ds4GgufError(f"not a readable GGUF file: {exc}") from exc
            return cls(path, reader)
        except Ds4GgufError as exc:
            raise Ds4GgufError(f"{path}: {exc}") from None

    # -- metadata access -----------------------------------------------------------------------

    def metadata_keys(self) -> list[str]:
        return [k for k in self._reader.fields if not k.startswith("GGUF.")]

    def _field(self, key: str) -> Any:
        return self._reader.fields.get(key)

    def _value(self, key: str, kinds: set[GGUFValueType], what: str, required: bool = True) -> Any:
        field = self._field(key)
        if field is None:
            if required:
                raise Ds4GgufError(f"required metadata key {key} is missing")
            return None
        if field.types[0] not in kinds:
            raise Ds4GgufError(f"metadata key {key} has type {field.types[0].name}, expected {what}")
        return field.contents()

    def _int(self, key: str, required: bool = True) -> int | None:
        value = self._value(key, _INT_TYPES, "an integer", required)
        if value is not None and value < 0:
            raise Ds4GgufError(f"metadata key {key} = {value} must not be negative")
        return None if value is None else int(value)

    def _float(self, key: str, required: bool = True) -> float | None:
        value = self._value(key, _FLOAT_TYPES, "a float", required)
        if value is None:
            return None
        return _shortest_float(value) if self._field(key).types[0] == GGUFValueType.FLOAT32 else float(value)

    def _bool(self, key: str, required: bool = True) -> bool | None:
        return self._value(key, {GGUFValueType.BOOL}, "a bool", required)

    def _str(self, key: str, required: bool = True) -> str | None:
        return self._value(key, {GGUFValueType.STRING}, "a string", required)

    def _array(
        self, key: str, item_kinds: set[GGUFValueType], what: str, required: bool = True
    ) -> list | None:
        field = self._field(key)
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

    def _ds4_int(self, name: str) -> int:
        value = self._int(KEY_PREFIX + name)
        assert value is not None
        return value

    def _ds4_float(self, name: str) -> float:
        value = self._float(KEY_PREFIX + name)
        assert value is not None
        return value

    # -- validation ----------------------------------------------------------------------------

    def _read_dims(self) -> Ds4GgufDims:
        arch = self._str("general.architecture")
        if arch != GGUF_ARCHITECTURE:
            raise Ds4GgufError(
                f"general.architecture is {arch!r}, expected {GGUF_ARCHITECTURE!r} (ds4 DeepSeek V4)"
            )
        k = self._ds4_int
        dims = Ds4GgufDims(
            n_layer=k("block_count"),
            n_embd=k("embedding_length"),
            n_vocab=k("vocab_size"),
            n_head=k("attention.head_count"),
            head_dim=k("attention.key_length"),
            n_rot=k("rope.dimension_count"),
            q_lora_rank=k("attention.q_lora_rank"),
            o_lora_rank=k("attention.output_lora_rank"),
            n_out_group=k("attention.output_group_count"),
            n_expert=k("expert_count"),
            n_expert_used=k("expert_used_count"),
            n_ff_exp=k("expert_feed_forward_length"),
            n_hash_layer=k("hash_layer_count"),
            indexer_heads=k("attention.indexer.head_count"),
            indexer_head_dim=k("attention.indexer.key_length"),
            n_hc=k("hyper_connection.count"),
        )

        def need(ok: bool, why: str) -> None:
            if not ok:
                raise Ds4GgufError(why)

        p = KEY_PREFIX
        for name, value in vars(dims).items():
            if name != "n_hash_layer":
                need(value > 0, f"metadata key {p}{_DIM_KEYS[name]} = {value} must be > 0")
        # Values ds4's graph only runs with one setting of (config_validate_model asserts them too).
        head_kv = k("attention.head_count_kv")
        need(head_kv == 1, f"{p}attention.head_count_kv = {head_kv}: ds4 shares one K=V head, expected 1")
        value_len = k("attention.value_length")
        need(
            value_len == dims.head_dim,
            f"{p}attention.value_length = {value_len} differs from {p}attention.key_length = {dims.head_dim} "
            "(K and V are the same vector)",
        )
        shared = k("expert_shared_count")
        need(shared == 1, f"{p}expert_shared_count = {shared}, expected 1")
        for key in ("expert_group_count", "expert_group_used_count"):
            v = self._int(p + key, required=False) or 0  # ds4: absent means 0
            need(v == 0, f"{p}{key} = {v}: group-limited routing is not supported, expected 0")
        need(
            dims.n_rot % 2 == 0 and dims.n_rot <= dims.head_dim,
            f"{p}rope.dimension_count = {dims.n_rot} must be even and <= {p}attention.key_length = {dims.head_dim}",
        )
        need(
            dims.n_rot <= dims.indexer_head_dim,
            f"{p}rope.dimension_count = {dims.n_rot} exceeds {p}attention.indexer.key_length = "
            f"{dims.indexer_head_dim}",
        )
        need(
            dims.n_head % dims.n_out_group == 0,
            f"{p}attention.head_count = {dims.n_head} is not divisible by "
            f"{p}attention.output_group_count = {dims.n_out_group}",
        )
        need(
            dims.n_expert_used <= dims.n_expert,
            f"{p}expert_used_count = {dims.n_expert_used} exceeds {p}expert_count = {dims.n_expert}",
        )
        need(
            dims.n_hash_layer <= dims.n_layer,
            f"{p}hash_layer_count = {dims.n_hash_layer} exceeds {p}block_count = {dims.n_layer}",
        )
        ratios = self._array(p + "attention.compress_ratios", _INT_TYPES, "integers")
        assert ratios is not None
        need(
            len(ratios) >= dims.n_layer,
            f"{p}attention.compress_ratios has {len(ratios)} entries, fewer than {p}block_count = {dims.n_layer}",
        )
        for il, got in enumerate(ratios[: dims.n_layer]):
            need(
                got == ds4_compress_ratio(il),
                f"{p}attention.compress_ratios[{il}] = {got}, expected {ds4_compress_ratio(il)} "
                "(ds4 rule: layers 0,1 ratio 0, even >= 2 ratio 4, odd >= 3 ratio 128)",
            )
        clamps = self._array(p + "swiglu_clamp_exp", _FLOAT_TYPES, "floats")
        assert clamps is not None
        need(
            len(clamps) >= dims.n_layer,
            f"{p}swiglu_clamp_exp has {len(clamps)} entries, fewer than {p}block_count = {dims.n_layer}",
        )
        need(
            len(set(clamps[: dims.n_layer])) == 1,
            f"{p}swiglu_clamp_exp differs between layers ({clamps[: dims.n_layer]}); one value is supported",
        )
        float32_array = self._field(p + "swiglu_clamp_exp").types[-1] == GGUFValueType.FLOAT32
        self._swiglu_limit = _shortest_float(clamps[0]) if float32_array else float(clamps[0])
        rope_type = self._str(p + "rope.scaling.type", required=False)
        need(rope_type in (None, "yarn"), f"{p}rope.scaling.type = {rope_type!r}, expected 'yarn'")
        norm = self._bool(p + "expert_weights_norm")
        need(norm is True, f"{p}expert_weights_norm = {norm}: ds4 renormalises routed weights, expected true")
        return dims

    def _check_tensors(self) -> None:
        missing = [s.gguf_name for s in self.layout if not s.optional and s.gguf_name not in self._tensors]
        if missing:
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise Ds4GgufError(f"required tensors are missing: {', '.join(missing[:5])}{more}")
        for spec in self.layout:
            t = self._tensors.get(spec.gguf_name)
            if t is None:
                continue
            if t.tensor_type not in spec.types:
                want = " or ".join(x.name for x in spec.types)
                raise Ds4GgufError(f"tensor {spec.gguf_name} has type {t.tensor_type.name}, expected {want}")
            got = tuple(int(x) for x in reversed(t.shape))
            if got != spec.shape:
                raise Ds4GgufError(
                    f"tensor {spec.gguf_name} has shape {list(got)} (torch order; GGUF dims "
                    f"{[int(x) for x in t.shape]}), expected {list(spec.shape)} from the deepseek4.* metadata"
                )
        for il in range(self.dims.n_layer):
            gate = self._tensors[f"blk.{il}.ffn_gate_exps.weight"].tensor_type
            up = self._tensors[f"blk.{il}.ffn_up_exps.weight"].tensor_type
            if gate != up:
                raise Ds4GgufError(
                    f"tensors blk.{il}.ffn_gate_exps.weight ({gate.name}) and blk.{il}.ffn_up_exps.weight "
                    f"({up.name}) must share one quant type"
                )
        vocab_field = self._field("tokenizer.ggml.tokens")
        if vocab_field is not None and len(vocab_field.data) != self.dims.n_vocab:
            raise Ds4GgufError(
                f"tokenizer.ggml.tokens has {len(vocab_field.data)} entries but {KEY_PREFIX}vocab_size = "
                f"{self.dims.n_vocab}"
            )

    # -- config --------------------------------------------------------------------------------

    def _build_config(self) -> Ds4Config:
        p, d = KEY_PREFIX, self.dims
        f = self._ds4_float
        rope_fraction = d.n_rot / d.head_dim
        orig_ctx = self._ds4_int("rope.scaling.original_context_length")
        factor = f("rope.scaling.factor")
        # ds4 only prints context_length; when absent, YaRN's reach (original x factor) is the limit.
        context = self._int(p + "context_length", required=False) or int(orig_ctx * factor)
        rope_theta, compress_theta = f("rope.freq_base"), f("attention.compress_rope_freq_base")
        bos = self._int("tokenizer.ggml.bos_token_id", required=False)
        eos = self._int("tokenizer.ggml.eos_token_id", required=False)
        for key, tok in (("tokenizer.ggml.bos_token_id", bos), ("tokenizer.ggml.eos_token_id", eos)):
            if tok is not None and tok >= d.n_vocab:
                raise Ds4GgufError(f"{key} = {tok} is outside the vocabulary ({p}vocab_size = {d.n_vocab})")
        try:
            return Ds4Config(
                architectures=[DS4_ARCHITECTURE],
                # ds4 runs its GGUF conversions of the official release with the official numerics.
                ds4_official_numerics=True,
                routed_expert_quant_bits=self._uniform_quant_bits(),
                dtype="float32",
                vocab_size=d.n_vocab,
                hidden_size=d.n_embd,
                num_hidden_layers=d.n_layer,
                num_attention_heads=d.n_head,
                num_key_value_heads=1,
                head_dim=d.head_dim,
                partial_rotary_factor=rope_fraction,
                q_lora_rank=d.q_lora_rank,
                o_groups=d.n_out_group,
                o_lora_rank=d.o_lora_rank,
                n_routed_experts=d.n_expert,
                num_experts_per_tok=d.n_expert_used,
                n_shared_experts=1,
                moe_intermediate_size=d.n_ff_exp,
                layer_types=[RATIO_TO_LAYER_TYPE[r] for r in d.compress_ratios],
                mlp_layer_types=["hash_moe"] * d.n_hash_layer + ["moe"] * (d.n_layer - d.n_hash_layer),
                sliding_window=self._ds4_int("attention.sliding_window"),
                index_n_heads=d.indexer_heads,
                index_head_dim=d.indexer_head_dim,
                index_topk=self._ds4_int("attention.indexer.top_k"),
                hc_mult=d.n_hc,
                hc_sinkhorn_iters=self._ds4_int("hyper_connection.sinkhorn_iterations"),
                hc_eps=f("hyper_connection.epsilon"),
                rms_norm_eps=f("attention.layer_norm_rms_epsilon"),
                routed_scaling_factor=f("expert_weights_scale"),
                norm_topk_prob=True,
                swiglu_limit=self._swiglu_limit,
                max_position_embeddings=context,
                num_nextn_predict_layers=0,  # MTP lives in a separate GGUF
                rope_theta=rope_theta,
                compress_rope_theta=compress_theta,
                rope_parameters={
                    "main": {
                        "rope_type": "default",
                        "rope_theta": rope_theta,
                        "partial_rotary_factor": rope_fraction,
                    },
                    "compress": {
                        "rope_type": "yarn",
                        "rope_theta": compress_theta,
                        "factor": factor,
                        "original_max_position_embeddings": orig_ctx,
                        "beta_fast": f("rope.scaling.yarn_beta_fast"),
                        "beta_slow": f("rope.scaling.yarn_beta_slow"),
                        "attention_factor": 1.0,  # ds4 applies no YaRN mscale
                        "partial_rotary_factor": rope_fraction,
                    },
                },
                bos_token_id=0 if bos is None else bos,
                eos_token_id=1 if eos is None else eos,
                tie_word_embeddings=False,
            )
        except ValueError as exc:  # Ds4Config.check_ds4_layout names the config field
            raise Ds4GgufError(f"the deepseek4.* metadata does not describe a ds4 model: {exc}") from exc

    def config(self) -> Ds4Config:
        """The model's config (a fresh copy each call, so callers may edit it)."""
        return Ds4Config.from_dict(self._config.to_dict())

    # -- weights -------------------------------------------------------------------------------

    def expert_quant_bits_by_layer(self) -> list[int]:
        """Per layer, 2 (IQ2_XXS gate/up + Q2_K down) or 4 (Q4_K) from the routed experts' types."""
        bits = []
        for il in range(self.dims.n_layer):
            names = (f"blk.{il}.ffn_{w}_exps.weight" for w in ("gate", "up", "down"))
            layer_bits = {EXPERT_TYPE_BITS[self._tensors[n].tensor_type] for n in names}
            if len(layer_bits) != 1:
                raise Ds4GgufError(f"layer {il} mixes 2-bit and 4-bit routed expert types")
            bits.append(layer_bits.pop())
        return bits

    def _uniform_quant_bits(self) -> int | None:
        """The experts' bits when every layer uses one recipe (what KVC headers record), else None."""
        bits = set(self.expert_quant_bits_by_layer())
        return bits.pop() if len(bits) == 1 else None

    def expert_quant_bits(self) -> int:
        """2 or 4: the routed experts' recipe. Raises for a mixed file (see the per-layer variant)."""
        bits = self.expert_quant_bits_by_layer()
        if len(set(bits)) != 1:
            four = [i for i, b in enumerate(bits) if b == 4]
            raise Ds4GgufError(
                f"{self.path}: routed experts mix 2-bit and 4-bit layers (4-bit: {four}); "
                "use expert_quant_bits_by_layer()"
            )
        return bits[0]

    def native_names(self) -> list[str]:
        """The names `tensors()` yields, in its order."""
        return [s.native_name for s in self.layout]

    def tensor(self, native_name: str) -> torch.Tensor | QuantizedWeight:
        """One weight by native name (see `tensors()`)."""
        for spec in self.layout:
            if spec.native_name == native_name:
                return self._load(spec)
        raise KeyError(f"{self.path}: no tensor named {native_name!r} in the ds4 layout")

    def tensors(self) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(native name, weight) for every tensor of the layout, zero-copy over the memory map.

        F16/F32 tensors come as read-only torch tensors in their file dtype; Q8_0 and the routed
        experts' types as `QuantizedWeight` whose `data` is the file's uint8 blocks with the
        weight's leading dims (routed experts: one stacked [E, out, in] weight per projection).
        `gate.tid2eid` is converted to int64 (a copy); a missing `gate.bias` is yielded as zeros.
        Never write into the returned tensors: the map is read-only.
        """
        for spec in self.layout:
            yield spec.native_name, self._load(spec)

    def _load(self, spec: TensorSpec) -> torch.Tensor | QuantizedWeight:
        t = self._tensors.get(spec.gguf_name)
        if t is None:  # optional router bias
            return torch.zeros(spec.shape, dtype=torch.float32)
        if t.tensor_type == GgmlType.I32:
            return torch.from_numpy(np.asarray(t.data, dtype=np.int64))
        data = _from_memmap(t.data)
        if t.tensor_type in (GgmlType.F16, GgmlType.F32):
            return data
        return QuantizedWeight(
            qtype=GGML_TO_QUANT_TYPE[t.tensor_type], shape=spec.shape, data=data, mapped=True
        )

    # -- tokenizer -----------------------------------------------------------------------------

    def tokenizer_metadata(self) -> GgufTokenizerMetadata | None:
        """The embedded vocabulary, or None when the file carries no `tokenizer.ggml.tokens`."""
        if self._field("tokenizer.ggml.tokens") is None:
            return None
        strings = {GGUFValueType.STRING}
        tokens = self._array("tokenizer.ggml.tokens", strings, "strings")
        merges = self._array("tokenizer.ggml.merges", strings, "strings", required=False) or []
        types = self._array("tokenizer.ggml.token_type", _INT_TYPES, "integers", required=False)
        if types is not None and len(types) != len(tokens or []):
            raise Ds4GgufError(
                f"{self.path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens or [])} tokens"
            )
        return GgufTokenizerMetadata(
            model=self._str("tokenizer.ggml.model") or "",
            pre=self._str("tokenizer.ggml.pre", required=False),
            tokens=list(tokens or []),
            merges=list(merges),
            token_types=None if types is None else [int(x) for x in types],
            bos_token_id=self._int("tokenizer.ggml.bos_token_id", required=False),
            eos_token_id=self._int("tokenizer.ggml.eos_token_id", required=False),
            padding_token_id=self._int("tokenizer.ggml.padding_token_id", required=False),
            chat_template=self._str("tokenizer.chat_template", required=False),
        )


_DIM_KEYS = {
    "n_layer": "block_count",
    "n_embd": "embedding_length",
    "n_vocab": "vocab_size",
    "n_head": "attention.head_count",
    "head_dim": "attention.key_length",
    "n_rot": "rope.dimension_count",
    "q_lora_rank": "attention.q_lora_rank",
    "o_lora_rank": "attention.output_lora_rank",
    "n_out_group": "attention.output_group_count",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "n_ff_exp": "expert_feed_forward_length",
    "n_hash_layer": "hash_layer_count",
    "indexer_heads": "attention.indexer.head_count",
    "indexer_head_dim": "attention.indexer.key_length",
    "n_hc": "hyper_connection.count",
}


def _shortest_float(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(value)))


def _from_memmap(array: np.ndarray) -> torch.Tensor:
    """torch view of a read-only memmap slice (torch warns about non-writable arrays; it is intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
