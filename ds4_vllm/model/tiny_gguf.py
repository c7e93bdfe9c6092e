"""The embedded defaults `ds4-tiny-q2` and `ds4-tiny-q4`: the default model's shape as ds4 GGUFs.

Same widths as `default_model.default_config()` (6 layers, hidden 256, 4 heads of 128, 8 experts
with 6 active, ...) and the real DeepSeek V4 tokenizer embedded as `tokenizer.ggml.*`, in the
layout and quant types of the ds4 engine's files: Q8_0 attention/shared experts/LM head, F16
embedding/HC/router/compressor/indexer, F32 norms, and routed experts IQ2_XXS gate/up + Q2_K down
(q2) or Q4_K (q4). Weights are random, so the output is meaningless text.

Float weights are drawn like the default model's (N(0, 1/fan_in) linears, N(0, 1) embedding, ones
for norms) and quantized to Q8_0 with `gguf.quants`. Routed experts are random bytes in well-formed
blocks; the block scale d (and dmin) are set so the values are zero-mean with standard deviation
1/sqrt(fan_in), from the moments of uniformly random codes (see `_expert_scales`).

Everything is drawn from one seeded NumPy generator in a fixed order and written with
`gguf.GGUFWriter`, so every run writes the same bytes. `tiny_gguf_file(name)` writes a file once
into the cache (`$DS4_VLLM_CACHE/models/`) and reuses it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as GgmlType

from ds4_vllm.kvc.atomic import atomic_output
from ds4_vllm.model.config import Ds4Config
from ds4_vllm.model.default_model import CHAT_TEMPLATE, _tokenizer_files, cache_root, default_config
from ds4_vllm.model.embedded import EMBEDDED_GGUF_MODELS
from ds4_vllm.model.gguf_layout import GGUF_ARCHITECTURE, KEY_PREFIX, Ds4GgufDims, ds4_tensor_layout

# Bump when the recipe changes: the cache then materializes new files.
TINY_GGUF_VERSION = "v1"
TINY_GGUF_SEED = 20261201
#: Embedded model name -> its routed-experts recipe (`ds4-tiny-q2` -> q2).
TINY_GGUF_QUANTS = {name: name.rsplit("-", 1)[1] for name in EMBEDDED_GGUF_MODELS}

# Routed-expert types per recipe: (gate/up, down), as in ds4's published files.
EXPERT_TYPES = {"q2": (GgmlType.IQ2_XXS, GgmlType.Q2_K), "q4": (GgmlType.Q4_K, GgmlType.Q4_K)}

# llama.cpp token types.
_NORMAL, _CONTROL, _USER_DEFINED = 1, 3, 4


def _tokenizer_metadata() -> tuple[list[str], list[str], list[int]]:
    """Tokens, merges and token types of the default model's (real DeepSeek V4) tokenizer."""
    data = json.loads(_tokenizer_files()["tokenizer.json"])
    vocab: dict[str, int] = data["model"]["vocab"]
    size = max(max(vocab.values()), max(a["id"] for a in data["added_tokens"])) + 1
    tokens = [""] * size
    types = [_NORMAL] * size
    for text, i in vocab.items():
        tokens[i] = text
    for added in data["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = _CONTROL if added["special"] else _USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges, types


def _expert_scales(qtype: GgmlType, std: float) -> tuple[float, float]:
    """(d, dmin) giving zero-mean values of standard deviation `std` from uniformly random codes.

    Q2_K: v = d·sc·q − dmin·m with sc, m uniform on 0..15, q on 0..3: E[v] = 0 for dmin = 1.5·d,
    then E[v²] = 192.5·d². Q4_K: sc, m uniform on 0..63, q on 0..15: dmin = 7.5·d, E[v²] = 66727.5·d².
    IQ2_XXS: v = ±d·(0.5 + s)·0.25·g, s uniform on 0..15 and g a grid magnitude: E[v²] =
    d²·0.0625·85.25·mean(grid²), signs symmetric (no dmin).
    """
    if qtype == GgmlType.Q2_K:
        return std / math.sqrt(192.5), 1.5 * std / math.sqrt(192.5)
    if qtype == GgmlType.Q4_K:
        return std / math.sqrt(66727.5), 7.5 * std / math.sqrt(66727.5)
    if qtype == GgmlType.IQ2_XXS:
        gguf.quants.IQ2_XXS.init_grid()
        grid = gguf.quants.IQ2_XXS.grid
        assert grid is not None
        grid_sq = float(np.square(grid.astype(np.int64)).sum()) / grid.size  # exact: integer grid
        return std / math.sqrt(0.0625 * 85.25 * grid_sq), 0.0
    raise ValueError(f"no random-block recipe for {qtype.name}")


def _random_expert_blocks(
    rng: np.random.Generator, qtype: GgmlType, shape: tuple[int, ...], std: float
) -> np.ndarray:
    """uint8 [E, out, in/256·block_bytes]: random codes with the block scales of `_expert_scales`."""
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    *lead, n_in = shape
    blocks = rng.integers(0, 256, (*lead, n_in // block, type_size), dtype=np.uint8)
    d, dmin = _expert_scales(qtype, std)
    scales = np.array([d, dmin], dtype=np.float16).view(np.uint8)
    if qtype == GgmlType.IQ2_XXS:  # d first, then the codes
        blocks[..., 0:2] = scales[0:2]
    elif qtype == GgmlType.Q4_K:  # d, dmin first
        blocks[..., 0:4] = scales
    elif qtype == GgmlType.Q2_K:  # scales[16], qs[64], then d, dmin
        blocks[..., 80:84] = scales
    return blocks.reshape(*lead, n_in // block * type_size)


def _write_metadata(writer: gguf.GGUFWriter, config: Ds4Config, name: str) -> None:
    """Every deepseek4.* key ds4 reads, with the value types of ds4's files."""
    p, c = KEY_PREFIX, config
    dims = Ds4GgufDims.from_config(config)
    main, compress = c.rope_parameters["main"], c.rope_parameters["compress"]
    writer.add_string("general.name", f"{name} (random weights)")
    for key, value in (
        ("block_count", dims.n_layer),
        ("context_length", c.max_position_embeddings),
        ("embedding_length", dims.n_embd),
        ("vocab_size", dims.n_vocab),
        ("attention.head_count", dims.n_head),
        ("attention.head_count_kv", 1),
        ("attention.key_length", dims.head_dim),
        ("attention.value_length", dims.head_dim),
        ("rope.dimension_count", dims.n_rot),
        ("attention.q_lora_rank", dims.q_lora_rank),
        ("attention.output_lora_rank", dims.o_lora_rank),
        ("attention.output_group_count", dims.n_out_group),
        ("expert_count", dims.n_expert),
        ("expert_used_count", dims.n_expert_used),
        ("expert_feed_forward_length", dims.n_ff_exp),
        ("expert_shared_count", 1),
        ("hash_layer_count", dims.n_hash_layer),
        ("expert_group_count", 0),
        ("expert_group_used_count", 0),
        ("attention.sliding_window", c.sliding_window),
        ("attention.indexer.head_count", dims.indexer_heads),
        ("attention.indexer.key_length", dims.indexer_head_dim),
        ("attention.indexer.top_k", c.index_topk),
        ("hyper_connection.count", dims.n_hc),
        ("hyper_connection.sinkhorn_iterations", c.hc_sinkhorn_iters),
    ):
        writer.add_uint32(p + key, int(value))
    writer.add_key_value(
        p + "attention.compress_ratios",
        dims.compress_ratios,
        gguf.GGUFValueType.ARRAY,
        gguf.GGUFValueType.INT32,
    )
    writer.add_array(p + "swiglu_clamp_exp", [float(c.swiglu_limit)] * dims.n_layer)
    writer.add_uint64(
        p + "rope.scaling.original_context_length", int(compress["original_max_position_embeddings"])
    )
    writer.add_string(p + "rope.scaling.type", "yarn")
    for key, value in (
        ("rope.freq_base", main["rope_theta"]),
        ("rope.scaling.factor", compress["factor"]),
        ("rope.scaling.yarn_beta_fast", compress["beta_fast"]),
        ("rope.scaling.yarn_beta_slow", compress["beta_slow"]),
        ("attention.compress_rope_freq_base", compress["rope_theta"]),
        ("expert_weights_scale", c.routed_scaling_factor),
        ("attention.layer_norm_rms_epsilon", c.rms_norm_eps),
        ("hyper_connection.epsilon", c.hc_eps),
    ):
        writer.add_float32(p + key, float(value))
    writer.add_bool(p + "expert_weights_norm", True)


def _write_tokenizer(writer: gguf.GGUFWriter, config: Ds4Config) -> None:
    tokens, merges, types = _tokenizer_metadata()
    if len(tokens) != config.vocab_size:
        raise ValueError(
            f"the DeepSeek V4 tokenizer has {len(tokens)} tokens but vocab_size is {config.vocab_size}; "
            "pass embed_tokenizer=False for other vocabulary sizes"
        )
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "joyai-llm")
    writer.add_array("tokenizer.ggml.tokens", tokens)
    writer.add_array("tokenizer.ggml.merges", merges)
    writer.add_key_value(
        "tokenizer.ggml.token_type", types, gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32
    )
    writer.add_uint32("tokenizer.ggml.bos_token_id", config.bos_token_id)
    writer.add_uint32("tokenizer.ggml.eos_token_id", config.eos_token_id)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)


def write_tiny_gguf(
    path: str | os.PathLike[str],
    quant: str,
    *,
    config: Ds4Config | None = None,
    seed: int = TINY_GGUF_SEED,
    embed_tokenizer: bool = True,
) -> Path:
    """Write a random ds4-layout GGUF with routed experts `quant` ("q2" or "q4") to `path`.

    `config` defaults to the default model's; hidden size and expert width must be multiples of
    256 (the K-quant block). `embed_tokenizer=False` leaves out `tokenizer.*` (needed when the
    vocabulary is not DeepSeek V4's 129,280 tokens).
    """
    if quant not in EXPERT_TYPES:
        raise ValueError(f"quant must be one of {sorted(EXPERT_TYPES)}, got {quant!r}")
    config = config or default_config()
    path = Path(path)
    gate_up_type, down_type = EXPERT_TYPES[quant]
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch=GGUF_ARCHITECTURE)
    _write_metadata(writer, config, f"ds4-tiny-{quant}")
    if embed_tokenizer:
        _write_tokenizer(writer, config)

    def normal(shape: tuple[int, ...], std: float) -> np.ndarray:
        arr = rng.standard_normal(shape, dtype=np.float32)
        arr *= np.float32(std)
        return arr

    for spec in ds4_tensor_layout(Ds4GgufDims.from_config(config)):
        native, shape, qtype = spec.native_name, spec.shape, spec.types[0]
        fan_in_std = shape[-1] ** -0.5
        if native.endswith(("experts.w1", "experts.w3", "experts.w2")):
            qtype = down_type if native.endswith("w2") else gate_up_type
            data = _random_expert_blocks(rng, qtype, shape, fan_in_std)
            writer.add_tensor(spec.gguf_name, data, raw_dtype=qtype)
            continue
        if native.endswith("tid2eid"):  # each token picks n distinct experts
            order = np.argsort(rng.random((shape[0], config.n_routed_experts)), axis=1, kind="stable")
            writer.add_tensor(spec.gguf_name, np.ascontiguousarray(order[:, : shape[1]].astype(np.int32)))
            continue
        if native.endswith(("norm.weight", "_scale")):
            values = np.ones(shape, np.float32)
        elif native.endswith(("_base", "attn_sink")):
            values = np.zeros(shape, np.float32)
        elif native == "embed.weight":
            values = normal(shape, 1.0)
        elif native.endswith("_fn"):  # small hyper-connection mixing, as in the default model
            values = normal(shape, 0.01)
        elif native.endswith(("ape", "gate.bias")):
            values = normal(shape, 0.1)
        else:
            values = normal(shape, fan_in_std)
        if qtype == GgmlType.Q8_0:
            writer.add_tensor(spec.gguf_name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
        elif qtype == GgmlType.F16:
            writer.add_tensor(spec.gguf_name, values.astype(np.float16))
        else:
            writer.add_tensor(spec.gguf_name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def tiny_gguf_path(name: str) -> Path:
    """Where the embedded default `name` ("ds4-tiny-q2" / "ds4-tiny-q4") lives; nothing is written."""
    if name not in TINY_GGUF_QUANTS:
        raise ValueError(f"unknown embedded GGUF {name!r}; known: {sorted(TINY_GGUF_QUANTS)}")
    return cache_root() / "models" / f"{name}-{TINY_GGUF_VERSION}.gguf"


def tiny_gguf_file(name: str) -> Path:
    """The embedded default's GGUF, written on first use (temp file + atomic rename)."""
    final = tiny_gguf_path(name)
    if final.is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(final, mode=0o644) as tmp:
        write_tiny_gguf(tmp, TINY_GGUF_QUANTS[name])
    return final


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(TINY_GGUF_QUANTS):
        sys.stdout.write(f"{tiny_gguf_file(arg)}\n")
