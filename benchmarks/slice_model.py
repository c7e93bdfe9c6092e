"""A real-width slice of DeepSeek V4 Flash as a ds4 GGUF, for benchmarks only (issue 11).

Why: the default `ds4` model is 16x narrower than DeepSeek V4 Flash, so restoring a checkpoint vs
recomputing a prefill costs nothing like it does on the real model. This slice has the real
widths (hidden 4096, 64 heads of 512, q-LoRA 1024, 8 output groups of 1024, indexer 64 heads of
128, 256 routed experts with 6 active of width 2048, vocab 129,280, window 128, the real RoPE/YaRN
and context 1,048,576) and the first four layers of the real schedule: two window-only layers,
one ratio-4 layer (compressor + indexer) and one ratio-128 layer; layers 0-2 are hash-routed, as
in the real model.

The file is quantized like ds4's q2 files (`ds4_tensor_layout`'s types): Q8_0 attention, shared
experts and LM head, F16 embedding/HC/router/compressors/indexer, F32 norms, routed experts
IQ2_XXS gate/up and Q2_K down; the loader keeps all of them packed (memory-mapped). Bytes are
generated directly, never quantized from floats: random codes in well-formed blocks with scales
that give zero-mean values of standard deviation 1/sqrt(fan_in) (`tiny_gguf._expert_scales`; for
Q8_0, uniform int8 codes in -127..127). Everything comes from one seeded generator in file order.

Memory: one layer's routed experts are 1.8 GB packed (256 x 3 x 4096 x 2048 at 2.06/2.63 bits),
so four distinct stacks plus the 1.6 GB embedding and head would be ~9.5 GB on a 24 GB machine
shared by several engineers. By default all layers' routed-expert tensors therefore point at the
same bytes in the file (`expert_stacks=1`: GGUF tensor infos may share a data offset, and the
loader maps the file, so the stack is resident once): every layer still dequantizes and multiplies
its full-width experts, so per-layer compute and memory traffic are the real model's, while the
file and the resident weights stay at ~4.1 GB. `expert_stacks=4` writes distinct stacks.

    python -m benchmarks.slice_model [DEST_DIR]     # prints the path (made once, then cached)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GgmlType

from ds4_vllm.kvc.atomic import atomic_output
from ds4_vllm.model.config import Ds4Config, flash_config
from ds4_vllm.model.default_model import cache_root
from ds4_vllm.model.gguf_layout import GGUF_ARCHITECTURE, Ds4GgufDims, ds4_tensor_layout
from ds4_vllm.model.tiny_gguf import (
    EXPERT_TYPES,
    _expert_scales,
    _random_expert_blocks,
    _write_metadata,
    _write_tokenizer,
)

#: Bump when the recipe changes: the content hash (file name) changes with it.
SLICE_RECIPE_VERSION = "slice-v1"
SLICE_SEED = 20261211
SLICE_QUANT = "q2"  # ds4's q2 recipe: IQ2_XXS gate/up, Q2_K down ("q4": Q4_K, ds4's q4 files)
#: DeepSeek V4 Flash's first four layers: ratios 0, 0, 4, 128; hash routing on layers 0-2.
SLICE_LAYERS = 4
# E[q^2] of int8 codes uniform on -127..127: 2 * sum(q^2, q=1..127) / 255 = 1,381,760 / 255.
_Q8_CODE_MEAN_SQUARE = 1381760 / 255
# Values generated per chunk (bounds transient memory to a few hundred MB).
_CHUNK_VALUES = 64 << 20


def slice_config(n_routed_experts: int = 256, num_layers: int = SLICE_LAYERS, **overrides: Any) -> Ds4Config:
    """DeepSeek V4 Flash's config with `num_layers` layers (real widths unless overridden).

    `n_routed_experts` and `overrides` (any Ds4Config field, e.g. `hidden_size`) exist for
    reduced variants in tests; the benchmark uses the defaults.
    """
    return flash_config(num_hidden_layers=num_layers, n_routed_experts=n_routed_experts, **overrides)


def recipe(config: Ds4Config, expert_stacks: int, seed: int, quant: str = SLICE_QUANT) -> dict[str, Any]:
    """Everything the file's bytes depend on (its hash names the cached file)."""
    return {
        "version": SLICE_RECIPE_VERSION,
        "seed": seed,
        "quant": quant,
        "expert_stacks": expert_stacks,
        "gguf": gguf.__name__ + " " + getattr(gguf, "__version__", ""),
        "config": json.loads(config.to_json_string(use_diff=False)),
    }


def recipe_digest(config: Ds4Config, expert_stacks: int, seed: int, quant: str = SLICE_QUANT) -> str:
    text = json.dumps(recipe(config, expert_stacks, seed, quant), sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class _SharedOffsetGgufWriter(gguf.GGUFWriter):
    """GGUFWriter whose tensor infos may point at another tensor's data (`aliases`: name -> target).

    Aliased tensors get the target's offset and take no space; the others are laid out in order.
    Data is streamed by the caller (`stream_data`) instead of being held in memory.
    """

    def __init__(self, path: Path, aliases: dict[str, str]) -> None:
        super().__init__(path, arch=GGUF_ARCHITECTURE)
        self.aliases = aliases

    def write_ti_data_to_file(self) -> None:
        assert self.fout is not None and len(self.fout) == 1
        ti_data = bytearray()
        offsets: dict[str, int] = {}
        offset = 0
        for name, ti in self.tensors[0].items():
            if name in self.aliases:
                offsets[name] = offsets[self.aliases[name]]
            else:
                offsets[name] = offset
                offset += gguf.GGUFWriter.ggml_pad(ti.nbytes, self.data_alignment)
            ti_data += self._pack_val(name, gguf.GGUFValueType.STRING, add_vtype=False)
            ti_data += self._pack("I", len(ti.shape))
            for dim in reversed(ti.shape):
                ti_data += self._pack("Q", dim)
            ti_data += self._pack("I", ti.dtype)
            ti_data += self._pack("Q", offsets[name])
        self.fout[0].write(ti_data)
        self.write_padding(self.fout[0], self.fout[0].tell())
        self.fout[0].flush()


def _q8_0_blocks(rng: np.random.Generator, rows: int, n_in: int, std: float) -> np.ndarray:
    """uint8 [rows, n_in/32*34]: Q8_0 blocks of uniform int8 codes with scale d = std/rms(code)."""
    blocks = rng.integers(-127, 128, (rows, n_in // 32, 34), dtype=np.int8).view(np.uint8)
    d = np.array([std / math.sqrt(_Q8_CODE_MEAN_SQUARE)], dtype=np.float16).view(np.uint8)
    blocks[..., 0:2] = d
    return blocks.reshape(rows, -1)


def _row_chunks(shape: tuple[int, ...]) -> Iterator[int]:
    """Leading-dim chunk sizes that keep each generated chunk under `_CHUNK_VALUES` values."""
    rows, per_row = shape[0], math.prod(shape[1:])
    step = max(1, _CHUNK_VALUES // max(per_row, 1))
    for start in range(0, rows, step):
        yield min(step, rows - start)


def write_slice_gguf(
    path: str | os.PathLike[str],
    config: Ds4Config,
    *,
    expert_stacks: int = 1,
    seed: int = SLICE_SEED,
    quant: str = SLICE_QUANT,
) -> Path:
    """Write the slice GGUF for `config` to `path` (streamed; a few hundred MB of transient memory).

    Layer `il`'s routed-expert tensors share the data of layer `il % expert_stacks`.
    """
    if expert_stacks < 1:
        raise ValueError(f"expert_stacks must be >= 1, got {expert_stacks}")
    path = Path(path)
    dims = Ds4GgufDims.from_config(config)
    layout = ds4_tensor_layout(dims)
    if quant not in EXPERT_TYPES:
        raise ValueError(f"quant must be one of {sorted(EXPERT_TYPES)}, got {quant!r}")
    gate_up_type, down_type = EXPERT_TYPES[quant]
    aliases: dict[str, str] = {}
    for spec in layout:
        if ".ffn_" in spec.gguf_name and "_exps." in spec.gguf_name:
            il = int(spec.gguf_name.split(".")[1])
            if il % expert_stacks != il:
                aliases[spec.gguf_name] = spec.gguf_name.replace(
                    f"blk.{il}.", f"blk.{il % expert_stacks}.", 1
                )

    def qtype_of(native: str, default: GgmlType) -> GgmlType:
        if native.endswith(("experts.w1", "experts.w3")):
            return gate_up_type
        return down_type if native.endswith("experts.w2") else default

    writer = _SharedOffsetGgufWriter(path, aliases)
    _write_metadata(writer, config, "ds4-slice")
    if config.vocab_size == 129280:
        _write_tokenizer(writer, config)
    for spec in layout:
        qtype = qtype_of(spec.native_name, spec.types[0])
        *lead, n_in = spec.shape
        if qtype in (GgmlType.F16, GgmlType.F32, GgmlType.I32):
            dtype = {GgmlType.F16: np.float16, GgmlType.F32: np.float32, GgmlType.I32: np.int32}[qtype]
            nbytes = math.prod(spec.shape) * np.dtype(dtype).itemsize
            writer.add_tensor_info(spec.gguf_name, spec.shape, np.dtype(dtype), nbytes)
        else:
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            byte_shape = (*lead, n_in // block * type_size)
            writer.add_tensor_info(
                spec.gguf_name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype
            )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]  # type: ignore[index]
    rng = np.random.default_rng(seed)
    for spec in layout:
        if spec.gguf_name in aliases:
            continue
        qtype = qtype_of(spec.native_name, spec.types[0])
        native, shape = spec.native_name, spec.shape
        std = shape[-1] ** -0.5
        written = 0
        for part in _tensor_chunks(rng, native, shape, qtype, std, config):
            part.tofile(fout)
            written += part.nbytes
        writer.write_padding(fout, written)
    writer.close()
    return path


def _tensor_chunks(
    rng: np.random.Generator,
    native: str,
    shape: tuple[int, ...],
    qtype: GgmlType,
    std: float,
    config: Ds4Config,
) -> Iterator[np.ndarray]:
    """The tensor's bytes in leading-dim chunks, initialised like `tiny_gguf.write_tiny_gguf`."""
    if native.endswith("tid2eid"):  # each token picks n distinct experts
        for rows in _row_chunks((shape[0], config.n_routed_experts)):
            order = np.argsort(rng.random((rows, config.n_routed_experts)), axis=1, kind="stable")
            yield np.ascontiguousarray(order[:, : shape[1]].astype(np.int32))
        return
    if qtype in (GgmlType.IQ2_XXS, GgmlType.Q2_K, GgmlType.Q4_K):
        for rows in _row_chunks(shape):
            yield _random_expert_blocks(rng, qtype, (rows, *shape[1:]), std)
        return
    if qtype == GgmlType.Q8_0:
        flat_rows = math.prod(shape[:-1])
        for rows in _row_chunks((flat_rows, shape[-1])):
            yield _q8_0_blocks(rng, rows, shape[-1], std)
        return
    dtype = np.float16 if qtype == GgmlType.F16 else np.float32
    if native.endswith(("norm.weight", "_scale")):
        yield np.ones(shape, dtype)
        return
    if native.endswith(("_base", "attn_sink")):
        yield np.zeros(shape, dtype)
        return
    if native == "embed.weight":
        std = 1.0
    elif native.endswith("_fn"):  # small hyper-connection mixing, as in the default model
        std = 0.01
    elif native.endswith(("ape", "gate.bias")):
        std = 0.1
    for rows in _row_chunks(shape):
        values = rng.standard_normal((rows, *shape[1:]), dtype=np.float32)
        values *= np.float32(std)
        yield values.astype(dtype, copy=False)


def slice_model_path(
    dest: Path, config: Ds4Config, expert_stacks: int = 1, seed: int = SLICE_SEED, quant: str = SLICE_QUANT
) -> Path:
    """Where the slice for these inputs lives under `dest`; nothing is written."""
    return Path(dest) / f"ds4-slice-{recipe_digest(config, expert_stacks, seed, quant)}.gguf"


def make_slice_model(
    dest: Path | None = None,
    *,
    config: Ds4Config | None = None,
    expert_stacks: int = 1,
    seed: int = SLICE_SEED,
    quant: str = SLICE_QUANT,
) -> Path:
    """The slice GGUF under `dest` (default `$DS4_VLLM_CACHE/models/`), written once per recipe.

    The file name carries the hash of everything its bytes depend on (`recipe`), so a cached file
    is reused only when it would be byte-identical; written to a temp file and renamed. `quant`
    "q4" writes Q4_K routed experts (ds4's q4 files; 3.6 GB per stack instead of 1.8).
    """
    config = config or slice_config()
    dest = Path(dest) if dest is not None else cache_root() / "models"
    final = slice_model_path(dest, config, expert_stacks, seed, quant)
    if final.is_file():
        return final
    dest.mkdir(parents=True, exist_ok=True)
    with atomic_output(final, mode=0o644) as tmp:
        write_slice_gguf(tmp, config, expert_stacks=expert_stacks, seed=seed, quant=quant)
    return final


def slice_for(spec: str) -> tuple[Ds4Config, Path, str]:
    """(config, GGUF path, label) for a benchmark's model argument "slice" or "slice:N".

    N is the routed-expert count (default 256); every other width is real. The file is made
    once (`make_slice_model`).
    """
    name, colon, experts = spec.partition(":")
    if name != "slice" or (colon and not (experts.isdigit() and int(experts) > 0)):
        raise ValueError(f'slice model {spec!r}: expected "slice" or "slice:N" (N routed experts)')
    config = slice_config(n_routed_experts=int(experts or 256))
    label = (
        "slice" if config.n_routed_experts == 256 else f"slice with {config.n_routed_experts} routed experts"
    )
    return config, make_slice_model(config=config), label


def expected_scale(qtype: GgmlType, std: float) -> tuple[float, float]:
    """(d, dmin) the generator writes into routed-expert blocks (re-exported for tests)."""
    return _expert_scales(qtype, std)


if __name__ == "__main__":
    print(make_slice_model(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
