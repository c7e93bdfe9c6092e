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

The layout (`gguf_layout`) is ds4's (`weights_bind` / `weights_validate_layout` in `ds4.c`); typed
key access and the tokenizer vocabulary live in `gguf_metadata`. The widths come
from the file's metadata instead of the engine's compiled-in Flash constants, so small test models
in the same layout open too. Only tensors ds4 reads are checked and handed out; `mtp.*` (the
separate speculative-decoding file) and any other extra tensors are ignored.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

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
from ds4_vllm.model.gguf_layout import (
    DIM_KEYS,
    EXPERT_TYPE_BITS,
    GGML_TO_QUANT_TYPE,
    GGUF_ARCHITECTURE,
    KEY_PREFIX,
    Ds4GgufDims,
    TensorSpec,
    ds4_tensor_layout,
)
from ds4_vllm.model.gguf_metadata import (
    FLOAT_TYPES,
    INT_TYPES,
    BoundsCheckedReader,
    Ds4GgufError,
    GgufMetadata,
    GgufTokenizerMetadata,
    read_tokenizer_metadata,
    shortest_float,
)
from ds4_vllm.model.quant import QuantizedWeight

# ---------------------------------------------------------------------------------------------
# The reader
# ---------------------------------------------------------------------------------------------


class Ds4GgufFile:
    """An opened, validated ds4 GGUF. Build with `Ds4GgufFile.open(path)`."""

    def __init__(self, path: Path, reader: gguf.GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self.metadata = GgufMetadata(reader)
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
                reader = BoundsCheckedReader(path, "r")
            except Ds4GgufError:
                raise
            except (ValueError, KeyError, UnicodeDecodeError) as exc:
                raise Ds4GgufError(f"not a readable GGUF file: {exc}") from exc
            return cls(path, reader)
        except Ds4GgufError as exc:
            raise Ds4GgufError(f"{path}: {exc}") from None

    def metadata_keys(self) -> list[str]:
        return self.metadata.keys()

    def tokenizer_metadata(self) -> GgufTokenizerMetadata | None:
        """The embedded vocabulary, or None when the file carries no `tokenizer.ggml.tokens`."""
        return read_tokenizer_metadata(self.metadata, self.path)

    def _ds4_int(self, name: str) -> int:
        value = self.metadata.get_int(KEY_PREFIX + name)
        assert value is not None
        return value

    def _ds4_float(self, name: str) -> float:
        value = self.metadata.get_float(KEY_PREFIX + name)
        assert value is not None
        return value

    # -- validation ----------------------------------------------------------------------------

    def _read_dims(self) -> Ds4GgufDims:
        arch = self.metadata.get_str("general.architecture")
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
                need(value > 0, f"metadata key {p}{DIM_KEYS[name]} = {value} must be > 0")
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
            v = self.metadata.get_int(p + key, required=False) or 0  # ds4: absent means 0
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
        ratios = self.metadata.get_array(p + "attention.compress_ratios", INT_TYPES, "integers")
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
        clamps = self.metadata.get_array(p + "swiglu_clamp_exp", FLOAT_TYPES, "floats")
        assert clamps is not None
        need(
            len(clamps) >= dims.n_layer,
            f"{p}swiglu_clamp_exp has {len(clamps)} entries, fewer than {p}block_count = {dims.n_layer}",
        )
        need(
            len(set(clamps[: dims.n_layer])) == 1,
            f"{p}swiglu_clamp_exp differs between layers ({clamps[: dims.n_layer]}); one value is supported",
        )
        float32_array = self.metadata.field(p + "swiglu_clamp_exp").types[-1] == GGUFValueType.FLOAT32
        self._swiglu_limit = shortest_float(clamps[0]) if float32_array else float(clamps[0])
        rope_type = self.metadata.get_str(p + "rope.scaling.type", required=False)
        need(rope_type in (None, "yarn"), f"{p}rope.scaling.type = {rope_type!r}, expected 'yarn'")
        norm = self.metadata.get_bool(p + "expert_weights_norm")
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
        vocab_field = self.metadata.field("tokenizer.ggml.tokens")
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
        context = self.metadata.get_int(p + "context_length", required=False) or int(orig_ctx * factor)
        rope_theta, compress_theta = f("rope.freq_base"), f("attention.compress_rope_freq_base")
        bos = self.metadata.get_int("tokenizer.ggml.bos_token_id", required=False)
        eos = self.metadata.get_int("tokenizer.ggml.eos_token_id", required=False)
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


def _from_memmap(array: np.ndarray) -> torch.Tensor:
    """torch view of a read-only memmap slice (torch warns about non-writable arrays; it is intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)
