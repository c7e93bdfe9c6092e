"""Quantized checkpoints for tests and benchmarks, and their dequantized references.

- `write_official_checkpoint`: a DeepSeek V4 model in the official release's form (native names,
  FP8 E4M3 linears with UE8M0 128x128 block scales, MXFP4 routed experts, BF16/F32/I64 for the
  rest as `checkpoint-formats.md` §2 lists, config.json with `compress_ratios`,
  `num_hash_layers`, `quantization_config` and `expert_dtype`). The quantizers here are plain
  torch (`float8_e4m3fn` cast, nearest-value E2M1 codes), independent of `ds4_vllm.model.quant`.
- `official_reference_weights`: that checkpoint's tensors as float32, the FP8/FP4 pairs
  dequantized by transformers' own `Fp8Dequantize`.
- `gguf_reference_weights`: a ds4 GGUF's tensors as float32 under native names, dequantized by
  gguf-py's numpy `gguf.quants.dequantize` from gguf-py's own reader.
- `transformers_model`: transformers' `DeepseekV4ForCausalLM` on such native-named float weights
  (transformers' checkpoint conversion maps native names itself).
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_BLOCK = 128
MXFP4_GROUP = 32
E2M1_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

# Native-name families by on-disk dtype in the official release (checkpoint-formats.md §2).
_FP8_LINEAR = re.compile(
    r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"
)
_MXFP4_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
_F32 = re.compile(r"(\.ape|\.attn_sink|hc_(head|attn|ffn)_(fn|base|scale)|\.gate\.bias)$")


def _e8m0(exponents: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes (value 2^(byte-127)) for integer power-of-two exponents."""
    return (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _power_of_two_scales(amax: torch.Tensor, top: float) -> torch.Tensor:
    """Smallest power-of-two exponents e with amax / 2^e <= top (0 for all-zero blocks)."""
    ratio = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    return torch.ceil(torch.log2(ratio)).to(torch.int32)


def quantize_fp8_block(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight (multiples of 128) -> (float8_e4m3fn [out, in], UE8M0 [out/128, in/128])."""
    out_dim, in_dim = weight.shape
    rows, cols = out_dim // FP8_BLOCK, in_dim // FP8_BLOCK
    if rows * FP8_BLOCK != out_dim or cols * FP8_BLOCK != in_dim:
        raise ValueError(f"FP8 block quantization needs multiples of {FP8_BLOCK}, got {tuple(weight.shape)}")
    blocks = weight.float().reshape(rows, FP8_BLOCK, cols, FP8_BLOCK)
    exponents = _power_of_two_scales(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    scaled = blocks / torch.exp2(exponents.float())[:, None, :, None]
    return scaled.reshape(out_dim, in_dim).to(torch.float8_e4m3fn), _e8m0(exponents)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] float weight -> (int8 [out, in/2] E2M1 code pairs, low nibble = even column;
    UE8M0 [out, in/32]). Each value takes the nearest E2M1 value of weight / group scale."""
    out_dim, in_dim = weight.shape
    groups = weight.float().reshape(out_dim, in_dim // MXFP4_GROUP, MXFP4_GROUP)
    exponents = _power_of_two_scales(groups.abs().amax(dim=2), float(E2M1_MAGNITUDES[-1]))
    scaled = (groups / torch.exp2(exponents.float())[..., None]).reshape(out_dim, in_dim)
    magnitude = (scaled.abs()[..., None] - E2M1_MAGNITUDES).abs().argmin(dim=-1)
    codes = (magnitude | torch.where(scaled < 0, 8, 0)).to(torch.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), _e8m0(exponents)


def native_name(saved_name: str) -> str:
    """The official release's name for a transformers `save_pretrained` name (checkpoint-formats.md §1)."""
    name = re.sub(r"^model\.embed_tokens\.", "embed.", saved_name)
    name = re.sub(r"^model\.hc_head\.hc_", "hc_head_", name)
    name = re.sub(r"^model\.", "", name)
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name)


def official_config_dict(config: Any) -> dict[str, Any]:
    """config.json of the official release's form for the model `config` (a Ds4Config)."""
    compress = config.rope_parameters["compress"]
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "qk_rope_head_dim": config.rope_dim,
        "q_lora_rank": config.q_lora_rank,
        "o_lora_rank": config.o_lora_rank,
        "o_groups": config.o_groups,
        "n_routed_experts": config.n_routed_experts,
        "n_shared_experts": config.n_shared_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_hash_layers": config.mlp_layer_types.count("hash_moe"),
        "scoring_func": config.scoring_func,
        "routed_scaling_factor": config.routed_scaling_factor,
        "swiglu_limit": config.swiglu_limit,
        "sliding_window": config.sliding_window,
        "index_n_heads": config.index_n_heads,
        "index_head_dim": config.index_head_dim,
        "index_topk": config.index_topk,
        "hc_mult": config.hc_mult,
        "hc_sinkhorn_iters": config.hc_sinkhorn_iters,
        "hc_eps": config.hc_eps,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position_embeddings,
        "num_nextn_predict_layers": 0,
        "compress_ratios": list(config.compress_ratios),
        "rope_theta": config.rope_parameters["main"]["rope_theta"],
        "compress_rope_theta": compress["rope_theta"],
        "rope_scaling": {
            "type": "yarn",
            "factor": compress["factor"],
            "original_max_position_embeddings": compress["original_max_position_embeddings"],
            "beta_fast": compress["beta_fast"],
            "beta_slow": compress["beta_slow"],
        },
        "expert_dtype": "fp4",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        },
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "tie_word_embeddings": False,
    }


def official_tensors(saved_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The official release's tensors (native names and dtypes) for a transformers-saved state dict."""
    out: dict[str, torch.Tensor] = {}
    for saved, tensor in saved_state.items():
        name = native_name(saved)
        if _FP8_LINEAR.match(name) or _MXFP4_EXPERT.match(name):
            quantize = quantize_fp8_block if _FP8_LINEAR.match(name) else quantize_mxfp4
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize(tensor)
        elif not tensor.dtype.is_floating_point:
            out[name] = tensor.to(torch.int64)  # gate.tid2eid
        elif _F32.search(name):
            out[name] = tensor.float().contiguous()
        else:
            out[name] = tensor.to(torch.bfloat16).contiguous()
    return out


def write_official_checkpoint(dest: Path, source: Path) -> Path:
    """Write the float model in `source` (our config.json, transformers' in-memory names, tokenizer
    files: e.g. the default model) to `dest` in the official release's form.

    transformers' own `save_pretrained` of a freshly built `DeepseekV4ForCausalLM` gives the
    native names (with the §1 renames undone here); the float tensors are then quantized.
    """
    from safetensors.torch import load_file, save_file
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.config import Ds4Config, to_transformers_config

    config = Ds4Config.from_pretrained(source)
    model = DeepseekV4ForCausalLM(to_transformers_config(config))
    model.load_state_dict(load_file(str(source / "model.safetensors")), strict=True)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tensors = official_tensors(load_file(str(Path(tmp) / "model.safetensors")))
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(official_config_dict(config), indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, dest / name)
    return dest


def official_transformers_config(path: Path):
    """transformers' own reading of an official-form config.json (its legacy keys folded by
    `DeepseekV4Config`), without `quantization_config`: the reference gets dequantized weights."""
    from transformers import DeepseekV4Config

    data = json.loads((path / "config.json").read_text())
    data.pop("quantization_config")
    return DeepseekV4Config(**data)


def official_reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """float32 tensors of an official-form checkpoint; FP8/MXFP4 pairs by transformers' `Fp8Dequantize`."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    tensors = load_file(str(path / "model.safetensors"))
    dequantizer = Fp8Dequantize(None)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(".scale"):
            continue
        scale = tensors.get(name.removesuffix(".weight") + ".scale")
        if scale is not None:
            # transformers reads UE8M0 scale bytes as uint8 (2^(byte-127)).
            out[name] = dequantizer._dequantize_one(
                tensor, scale.view(torch.uint8), output_dtype=torch.float32
            )
        else:
            out[name] = tensor if not tensor.dtype.is_floating_point else tensor.float()
    return out


def gguf_reference_weights(path: Path) -> dict[str, torch.Tensor]:
    """float32 tensors of a ds4 GGUF under native names, dequantized by gguf-py from gguf-py's reader.

    Routed-expert stacks [E, out, in] become per-expert `layers.N.ffn.experts.E.wK.weight`, as the
    official release names them; `gate.tid2eid` becomes int64.
    """
    import gguf

    from ds4_vllm.model.gguf_file import Ds4GgufFile
    from ds4_vllm.model.gguf_layout import ds4_tensor_layout

    native_of = {
        spec.gguf_name: spec.native_name
        for spec in ds4_tensor_layout(Ds4GgufFile.open(path).dims)  # the layout's name table
    }
    out: dict[str, torch.Tensor] = {}
    for tensor in gguf.GGUFReader(path).tensors:
        name = native_of[tensor.name]
        if tensor.tensor_type == gguf.GGMLQuantizationType.I32:
            out[name] = torch.from_numpy(np.asarray(tensor.data, dtype=np.int64))
            continue
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
        if re.search(r"\.ffn\.experts\.w[123]$", name):
            stem, proj = name.rsplit(".", 1)
            for expert in range(values.shape[0]):
                out[f"{stem}.{expert}.{proj}.weight"] = values[expert].contiguous()
        else:
            out[name] = values.contiguous()
    return out


def write_float_checkpoint(
    dest: Path, weights: dict[str, torch.Tensor], config: Any, tokenizer_dir: Path
) -> Path:
    """A float safetensors directory (native names, `config` as our ds4 config.json) our loader serves."""
    from safetensors.torch import save_file

    dest.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(config.to_json_string())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, dest / name)
    return dest


def transformers_model(weights: dict[str, torch.Tensor], config: Any, workdir: Path):
    """transformers' DeepseekV4ForCausalLM (float32, eval) on native-named float `weights`.

    `config` is a transformers `DeepseekV4Config`. Loading must use every tensor and leave no
    weight missing, else ValueError names them.
    """
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    workdir.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(workdir / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(workdir)
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        workdir, config=config, dtype=torch.float32, output_loading_info=True
    )
    problems = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if problems or info.get("error_msgs"):
        raise ValueError(
            f"transformers did not take the checkpoint as is: {problems} {info.get('error_msgs')}"
        )
    return model.eval()
