"""register(): `ds4` resolves to the default model, and configs come out as Ds4Config (no engine)."""

from pathlib import Path

import pytest

pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    mp = pytest.MonkeyPatch()
    mp.setenv("DS4_VLLM_CACHE", str(tmp_path_factory.mktemp("cache")))
    from ds4_vllm.model.default_model import default_model_dir

    yield default_model_dir()
    mp.undo()


def test_register_is_idempotent() -> None:
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import ds4_vllm

    ds4_vllm.register()
    ds4_vllm._registered = False  # force the body to run again: must not raise
    ds4_vllm.register()
    assert "Ds4ForCausalLM" in ModelRegistry.get_supported_archs()
    assert "ds4disk" in KVConnectorFactory._registry


def test_engine_args_resolve_ds4(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS4_VLLM_CACHE", str(model_dir.parent.parent))
    from vllm.engine.arg_utils import EngineArgs

    from ds4_vllm.model.config import Ds4Config

    config = EngineArgs(model="ds4", max_model_len=2048).create_engine_config()
    mc = config.model_config
    assert mc.model == str(model_dir)
    assert mc.served_model_name == "ds4"
    assert mc.architectures == ["Ds4ForCausalLM"]
    assert isinstance(mc.hf_config, Ds4Config) and mc.hf_config.model_type == "ds4"
    assert not mc.use_mla  # vLLM's deepseek_v4 special cases stay off
    assert config.cache_config.enable_prefix_caching


def test_deepseek_v4_checkpoint_with_arch_override(model_dir: Path, tmp_path: Path) -> None:
    """A transformers `save_pretrained` dir (model_type deepseek_v4) + one hf_overrides entry."""
    import json

    from vllm.engine.arg_utils import EngineArgs

    from ds4_vllm.model.config import Ds4Config, to_transformers_config

    v4_dir = tmp_path / "v4"
    v4_dir.mkdir()
    to_transformers_config(Ds4Config.from_pretrained(model_dir)).save_pretrained(v4_dir)
    assert json.loads((v4_dir / "config.json").read_text())["model_type"] == "deepseek_v4"
    config = EngineArgs(
        model=str(v4_dir),
        tokenizer=str(model_dir),
        hf_overrides={"architectures": ["Ds4ForCausalLM"]},
        max_model_len=2048,
        load_format="dummy",
    ).create_engine_config()
    mc = config.model_config
    assert mc.architectures == ["Ds4ForCausalLM"]
    assert isinstance(mc.hf_config, Ds4Config) and mc.hf_config.model_type == "ds4"
    assert mc.hf_config.compress_ratios == [0, 0, 4, 128, 4, 128]
    assert not mc.use_mla
    assert config.cache_config.enable_prefix_caching  # not switched off as for deepseek_v4 on CPU
