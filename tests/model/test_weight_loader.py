"""The loader takes every DeepSeek V4 safetensors layout (no engine: the model is built directly).

Inputs come from transformers itself: a `DeepseekV4ForCausalLM` built by transformers and
written by its `save_pretrained` (the saved layout), its `state_dict()` (in-memory names), and the
native names of the official release, which differ from the saved layout by the four renames of
`checkpoint-formats.md` §1. Every layout must give exactly transformers' weights.
"""

from __future__ import annotations

import logging
import re

import pytest
import torch
from safetensors.torch import load_file

from ds4_vllm.model.config import Ds4Config, to_transformers_config
from ds4_vllm.model.weight_loader import CheckpointLoader

SMALL = dict(
    num_hidden_layers=4,
    hidden_size=64,
    num_attention_heads=2,
    head_dim=64,
    q_lora_rank=32,
    o_lora_rank=16,
    o_groups=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    index_n_heads=2,
    index_head_dim=64,
    vocab_size=512,
    sliding_window=16,
    num_hash_layers=2,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(our config, transformers model, its saved directory)."""
    from transformers import DeepseekV4ForCausalLM

    config = Ds4Config(**SMALL)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(to_transformers_config(config)).eval()
    with torch.no_grad():  # transformers zero-initialises some of these; make every tensor telling
        for name, param in model.named_parameters():
            if param.dtype.is_floating_point:
                param.copy_(torch.randn_like(param) * 0.02 + 0.01 * len(name) % 0.1)
        for layer in model.model.layers[:2]:
            layer.mlp.gate.tid2eid.copy_(
                torch.randint(0, SMALL["n_routed_experts"], layer.mlp.gate.tid2eid.shape)
            )
    out = tmp_path_factory.mktemp("v4") / "saved"
    model.save_pretrained(out)
    return config, model, out


def _native(saved_name: str) -> str:
    """The official release's name for a `save_pretrained` name (checkpoint-formats.md §1)."""
    name = re.sub(r"^model\.embed_tokens\.", "embed.", saved_name)
    name = re.sub(r"^model\.hc_head\.hc_", "hc_head_", name)
    name = re.sub(r"^model\.", "", name)
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.", r"\1.kv_norm.", name)


def _expected(model) -> dict[str, torch.Tensor]:
    """transformers' in-memory tensors under our names (gate_up split, indexer compressor nested)."""
    out = {}
    for name, tensor in model.state_dict().items():
        ours = re.sub(
            r"\.compressor\.indexer\.(kv_proj|gate_proj|position_bias|kv_norm)",
            r".compressor.indexer.compressor.\1",
            name,
        )
        if ours.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            out[ours.replace("gate_up_proj", "gate_proj.weight")] = gate
            out[ours.replace("gate_up_proj", "up_proj.weight")] = up
        elif ours.endswith("experts.down_proj"):
            out[f"{ours}.weight"] = tensor
        else:
            out[ours] = tensor
    return out


def _load(config, weights):
    """The model core (`Ds4CausalLM`: `model.*`, `lm_head`, no engine) loaded from `weights`."""
    from ds4_vllm.model.core import Ds4CausalLM

    holder = Ds4CausalLM(config, torch.float32)
    loaded = CheckpointLoader(holder, torch.float32).load(weights)
    return holder, loaded


def _assert_same(holder, model) -> None:
    ours = dict(holder.state_dict())
    expected = _expected(model)
    assert set(expected) == set(ours)
    for name, tensor in expected.items():
        assert torch.equal(ours[name], tensor.to(ours[name].dtype)), name


def test_saved_layout_loads_exactly(reference) -> None:
    config, model, saved = reference
    weights = load_file(saved / "model.safetensors")
    assert "head.weight" in weights and any(".ffn.experts.0.w1." in n for n in weights)
    holder, loaded = _load(config, weights.items())
    assert loaded == set(holder.state_dict())
    _assert_same(holder, model)


def test_native_layout_loads_exactly(reference) -> None:
    config, model, saved = reference
    weights = {_native(n): t for n, t in load_file(saved / "model.safetensors").items()}
    assert "embed.weight" in weights and "layers.0.attn.kv_norm.weight" in weights
    holder, _ = _load(config, weights.items())
    _assert_same(holder, model)


def test_in_memory_names_load_exactly(reference) -> None:
    config, model, _ = reference
    holder, _ = _load(config, model.state_dict().items())
    _assert_same(holder, model)


def test_resaved_in_memory_layout_loads_exactly(reference, tmp_path) -> None:
    """Loaded from in-memory names and saved again, transformers keeps them but writes `norm` for `kv_norm`."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    config, model, saved = reference
    first = tmp_path / "in_memory"
    first.mkdir()
    (first / "config.json").write_text((saved / "config.json").read_text())
    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, first / "model.safetensors")
    DeepseekV4ForCausalLM.from_pretrained(first).save_pretrained(tmp_path / "resaved")
    weights = load_file(tmp_path / "resaved" / "model.safetensors")
    assert "model.layers.2.self_attn.norm.weight" in weights
    holder, _ = _load(config, weights.items())
    _assert_same(holder, model)


def test_mtp_tensors_are_skipped_with_one_log_line(reference, caplog) -> None:
    config, model, saved = reference
    weights = {_native(n): t for n, t in load_file(saved / "model.safetensors").items()}
    weights["mtp.0.e_proj.weight"] = torch.zeros(4, 4)
    weights["mtp.0.norm.weight"] = torch.zeros(4)
    with caplog.at_level(logging.INFO, logger="ds4_vllm.model.weight_loader"):
        _load(config, weights.items())
    lines = [r.getMessage() for r in caplog.records if "mtp" in r.getMessage()]
    assert lines == ["Skipped 2 multi-token-prediction tensors (mtp.*): Ds4ForCausalLM has no MTP head"]


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda w: w.update({"layers.0.attn.wq_x.weight": torch.zeros(1)}),
            "'layers.0.attn.wq_x.weight' does not belong",
        ),
        (
            lambda w: w.update({"head.weight": torch.zeros(3, 3)}),
            "'head.weight': lm_head: weight has shape (3, 3), expected (512, 64)",
        ),
        (
            lambda w: w.pop("layers.3.ffn.experts.2.w3.weight"),
            "missing expert 2 of 'model.layers.3.mlp.experts.up_proj'",
        ),
        (lambda w: w.pop("norm.weight"), "missing tensor 'model.norm.weight'"),
        (
            lambda w: w.update({"layers.1.ffn.experts.9.w1.weight": torch.zeros(32, 64)}),
            "expert 9 is outside 0..3",
        ),
    ],
    ids=["unknown", "shape", "missing-expert", "missing", "expert-range"],
)
def test_bad_checkpoints_name_the_tensor(reference, edit, message) -> None:
    config, _, saved = reference
    weights = {_native(n): t for n, t in load_file(saved / "model.safetensors").items()}
    edit(weights)
    with pytest.raises(ValueError) as err:
        _load(config, weights.items())
    assert message in str(err.value)


def _checkpoint(kind: str, tmp_path) -> tuple:
    """(config, weights) of the tiny default in one of the formats users have."""
    from ds4_vllm.model.default_model import default_config, default_model_dir

    if kind == "safetensors":
        return default_config(), load_file(str(default_model_dir() / "model.safetensors")).items()
    if kind == "gguf-q2":
        from ds4_vllm.model.gguf_file import Ds4GgufFile
        from ds4_vllm.model.tiny_gguf import tiny_gguf_file

        gguf = Ds4GgufFile.open(tiny_gguf_file("ds4-tiny-q2"))
        return gguf.config(), gguf.tensors()
    from ds4_vllm.model.config_parser import Ds4ConfigParser
    from tests.model.quantized_checkpoints import write_official_checkpoint

    official = write_official_checkpoint(tmp_path / "official", default_model_dir())
    _, config = Ds4ConfigParser().parse(official, trust_remote_code=False)
    return config, load_file(str(official / "model.safetensors")).items()


@pytest.mark.parametrize("kind", ["safetensors", "gguf-q2", "official"])
def test_every_weight_lands_on_the_device_the_model_was_built_on(kind: str, tmp_path) -> None:
    """Issue 25: vLLM builds the model under its target device, then `load_weights` gets CPU
    tensors. 83 weights stayed on the CPU and a CUDA forward failed at the first projection.
    Built under the meta device (standing in for CUDA on this machine) and loaded from each
    weight format (transformers' safetensors, the engine's GGUF, the official FP8/MXFP4 release
    form), every parameter, buffer and packed weight is on meta."""
    from types import SimpleNamespace

    from vllm.config import CompilationConfig, CompilationMode, VllmConfig, set_current_vllm_config

    from ds4_vllm.model.model import Ds4ForCausalLM

    config, weights = _checkpoint(kind, tmp_path)
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(hf_config=config, dtype=torch.bfloat16),
        compilation_config=CompilationConfig(mode=CompilationMode.NONE),  # what `enforce_eager` sets
    )
    with set_current_vllm_config(VllmConfig()), torch.device("meta"):
        model = Ds4ForCausalLM(vllm_config=vllm_config)
    model.load_weights(weights)
    placed = {name: t.device.type for name, t in [*model.named_parameters(), *model.named_buffers()]}
    assert placed and {name for name, device in placed.items() if device != "meta"} == set()


def test_every_float_weight_is_in_the_model_dtype_after_loading() -> None:
    """Issue 25: built as vLLM builds it (default dtype bf16) from the default model's safetensors,
    transformers' whole `experts.down_proj` stacks stayed float32 and were cast on every MoE call.
    Every float parameter and buffer is now bf16; only RoPE's computed frequencies stay float32."""
    from ds4_vllm.model.default_model import default_config
    from tests.model.direct_model import build_model

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model(default_config(), torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)
    float32 = {
        re.sub(r"\.\d+\.", ".N.", name)
        for name, t in [*model.named_parameters(), *model.named_buffers()]
        if t.is_floating_point() and t.dtype != torch.bfloat16
    }
    assert float32 == {"model.layers.N.self_attn.rope.inv_freq"}
