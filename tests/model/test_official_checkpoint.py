"""The official release's form (FP8 + MXFP4, native names, its config.json) reads and loads as released.

The checkpoint is the default model quantized by `quantized_checkpoints` with plain torch; the
expected values are transformers' own `Fp8Dequantize` of the same bytes. No engine: the model is
built directly (the engine-level parity is in test_quantized_vs_transformers.py).
"""

from __future__ import annotations

import pytest
import torch

from ds4_vllm.model.quant import QuantType
from tests.model.quantized_checkpoints import (
    official_reference_weights,
    quantize_fp8_block,
    quantize_mxfp4,
    write_official_checkpoint,
)


@pytest.fixture(scope="module")
def official_dir(tmp_path_factory):
    from ds4_vllm.model.default_model import default_model_dir

    return write_official_checkpoint(tmp_path_factory.mktemp("official") / "ckpt", default_model_dir())


def test_config_format_reads_the_release_config_without_handing_vllm_its_fp8_method(official_dir):
    from ds4_vllm.model.config_parser import Ds4ConfigParser

    config_dict, config = Ds4ConfigParser().parse(official_dir, trust_remote_code=False)
    # vLLM takes quantization_config from this dict and would apply its own FP8 method.
    assert "quantization_config" not in config_dict
    assert config.checkpoint_quantization["weight_block_size"] == [128, 128]
    assert config.official_numerics is True  # a quantized release runs the official graph by default
    assert config.architectures == ["Ds4ForCausalLM"]
    assert config.compress_ratios == [0, 0, 4, 128, 4, 128]
    assert config.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3
    assert config.rope_dim == 64


def test_loader_keeps_the_release_packed_and_equal_to_transformers_dequantization(official_dir):
    from types import SimpleNamespace

    from safetensors.torch import load_file
    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config

    from ds4_vllm.model.config_parser import Ds4ConfigParser
    from ds4_vllm.model.model import Ds4ForCausalLM

    _, config = Ds4ConfigParser().parse(official_dir, trust_remote_code=False)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config, dtype=torch.float32),
        compilation_config=CompilationConfig(mode=CompilationMode.NONE),  # what `enforce_eager` sets
    )
    with set_current_vllm_config(VllmConfig()):  # a fresh registry of cache-layer names
        model = Ds4ForCausalLM(vllm_config=vllm_config)
    model.load_weights(load_file(str(official_dir / "model.safetensors")).items())
    expected = official_reference_weights(official_dir)

    attn = model.model.layers[2].self_attn
    assert attn.q_a_proj.qtype is QuantType.FP8_BLOCK
    assert torch.equal(attn.q_a_proj.dequantized_weight(), expected["layers.2.attn.wq_a.weight"])
    assert torch.equal(
        attn.compressor.indexer.q_b_proj.dequantized_weight(), expected["layers.2.attn.indexer.wq_b.weight"]
    )
    shared = model.model.layers[5].mlp.shared_experts.down_proj
    assert torch.equal(shared.dequantized_weight(), expected["layers.5.ffn.shared_experts.w2.weight"])
    experts = model.model.layers[3].mlp.experts
    assert experts.up_proj.qtype is QuantType.MXFP4
    for e in (0, 7):
        assert torch.equal(
            experts.up_proj.expert_weights([e])[0], expected[f"layers.3.ffn.experts.{e}.w3.weight"]
        )
        assert torch.equal(
            experts.down_proj.expert_weights([e])[0], expected[f"layers.3.ffn.experts.{e}.w2.weight"]
        )
    assert torch.equal(model.lm_head.dequantized_weight(), expected["head.weight"])  # BF16 in the file
    assert torch.equal(
        model.model.embed_tokens.weight.to(expected["embed.weight"].dtype), expected["embed.weight"]
    )


def test_fixture_quantizers_hit_the_grids_exactly():
    """Values already on the FP8 / E2M1 grids (times a power of two) survive quantization exactly."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(3)
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    codes = e2m1[torch.randint(0, len(e2m1), (64, 256), generator=g)]
    codes[:, ::32] = 6.0  # each group's amax is 6: scale exactly 2^k
    weight = codes * torch.exp2(torch.randint(-8, 3, (64, 8), generator=g).float()).repeat_interleave(32, 1)
    data, scale = quantize_mxfp4(weight)
    assert data.dtype == torch.int8 and tuple(data.shape) == (64, 128) and tuple(scale.shape) == (64, 8)
    assert torch.equal(
        Fp8Dequantize(None)._dequantize_one(data, scale.view(torch.uint8), torch.float32), weight
    )

    fp8 = torch.randn(256, 128, generator=g).to(torch.float8_e4m3fn).float() * 2.0**-6
    fp8[0, 0] = 448.0 * 2.0**-6  # block amax on the FP8 maximum
    fp8[128, 0] = 448.0 * 2.0**-6
    data, scale = quantize_fp8_block(fp8)
    assert data.dtype == torch.float8_e4m3fn and tuple(scale.shape) == (2, 1)
    assert torch.equal(Fp8Dequantize(None)._dequantize_one(data, scale.view(torch.uint8), torch.float32), fp8)
