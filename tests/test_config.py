"""Ds4Config validation and the embedded default model (materialization, transformers loading)."""

import hashlib
from pathlib import Path

import pytest

from ds4_vllm.model.config import Ds4Config, ds4_layer_types, register_auto_config, to_transformers_config
from ds4_vllm.model.default_model import default_config, default_model_dir, write_default_model


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"layer_types": ["sliding_attention"] * 6}, "layer_types"),
        (
            {"compress_rates": {"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}},
            "compress_rates",
        ),
        ({"hc_mult": 0}, "hc_mult"),
        ({"num_attention_heads": 4, "o_groups": 3}, "num_attention_heads"),
        ({"head_dim": 10, "partial_rotary_factor": 0.3}, "partial_rotary_factor"),  # 3 rotary dims: odd
        ({"head_dim": 128, "partial_rotary_factor": 0.5, "index_head_dim": 32}, "index_head_dim"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"mlp_layer_types": ["moe", "hash_moe", "moe", "moe", "moe", "moe"]}, "mlp_layer_types"),
        ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok"),
    ],
)
def test_invalid_config_names_field(overrides: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"Ds4Config\.{field}\b"):
        Ds4Config(num_hidden_layers=6, **overrides)


def test_defaults_follow_ds4_schedule() -> None:
    cfg = Ds4Config(num_hidden_layers=43)
    assert cfg.model_type == "ds4"
    assert cfg.layer_types == ds4_layer_types(43)
    assert cfg.compress_ratios[:6] == [0, 0, 4, 128, 4, 128] and cfg.compress_ratios[-1] == 4
    assert cfg.rope_dim == 64


def test_legacy_deepseek_v4_dict_is_understood() -> None:
    cfg = Ds4Config.from_config_dict(
        {
            "model_type": "deepseek_v4",
            "num_hidden_layers": 4,
            "compress_ratios": [0, 0, 4, 128],
            "num_hash_layers": 2,
            "qk_rope_head_dim": 64,
            "head_dim": 512,
            "rope_scaling": {
                "type": "yarn",
                "factor": 16,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        }
    )
    assert cfg.model_type == "ds4"
    assert cfg.compress_ratios == [0, 0, 4, 128]
    assert cfg.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert cfg.rope_dim == 64
    assert cfg.rope_parameters["compress"]["rope_type"] == "yarn"
    assert cfg.rope_parameters["main"]["rope_type"] == "default"


def test_default_config_structure() -> None:
    cfg = default_config()
    assert cfg.architectures == ["Ds4ForCausalLM"]
    assert cfg.compress_ratios == [0, 0, 4, 128, 4, 128]
    assert (cfg.vocab_size, cfg.hidden_size, cfg.rope_dim) == (129280, 256, 64)
    compress = cfg.rope_parameters["compress"]
    assert compress["rope_type"] == "yarn" and compress["factor"] == 16.0
    assert compress["rope_theta"] == 160000.0 and compress["attention_factor"] == 1.0


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_default_model_is_deterministic(tmp_path: Path) -> None:
    a = write_default_model(tmp_path / "a")
    b = write_default_model(tmp_path / "b")
    assert _digest(a) == _digest(b)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(_digest(a))


def test_default_model_dir_materializes_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS4_VLLM_CACHE", str(tmp_path))
    first = default_model_dir()
    assert first.parent == tmp_path / "models"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert default_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == [first.name]  # no temp dirs left


def test_transformers_loads_default_model(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    folder = write_default_model(tmp_path / "m")
    cfg = Ds4Config.from_pretrained(folder)
    model = DeepseekV4ForCausalLM.from_pretrained(folder, config=to_transformers_config(cfg))
    state = model.state_dict()
    weights = load_file(str(folder / "model.safetensors"))
    assert set(weights) == set(state)
    assert all(tuple(state[k].shape) == weights[k].shape for k in weights)
    tid2eid = weights["model.layers.0.mlp.gate.tid2eid"]
    assert all(len(set(row)) == len(row) for row in tid2eid[:1000].tolist())

    register_auto_config()
    tok = AutoTokenizer.from_pretrained(folder)
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    ids = tok("The quick brown fox jumps over the lazy dog", return_tensors="pt").input_ids
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    assert torch.isfinite(logprobs).all()
    assert logprobs.max(-1).values.exp().max() < 0.5  # random model: no single token dominates
    assert logprobs.argmax(-1).unique().numel() > 1  # not one token everywhere


def test_flash_config_has_the_released_widths() -> None:
    """`flash_config()` (the slice benchmark and, narrowed, the tiny default build on it) equals
    transformers' DeepseekV4Config defaults, the released Flash, except where ds4 differs on
    purpose: its layer rule, YaRN on the compressed RoPE, no MTP layer, an explicit dtype."""
    from transformers import DeepseekV4Config

    from ds4_vllm.model.config import flash_config, to_transformers_config

    ours = to_transformers_config(flash_config()).to_dict()
    released = DeepseekV4Config().to_dict()
    differ = {k for k in ours.keys() | released.keys() if ours.get(k) != released.get(k)}
    assert differ == {"layer_types", "rope_parameters", "num_nextn_predict_layers", "dtype", "architectures"}
    assert (ours["hidden_size"], ours["num_hidden_layers"], ours["n_routed_experts"]) == (4096, 43, 256)
