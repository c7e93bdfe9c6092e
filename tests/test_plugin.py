"""register(): `ds4` resolves to the default model, configs come out as Ds4Config, and the
`vllm serve` / `ds4-vllm serve` command lines are rewritten (no engine)."""

import json
import sys
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


@pytest.fixture
def v4_dir(model_dir: Path, tmp_path: Path) -> Path:
    """The default model's config as transformers' `save_pretrained` writes it (model_type deepseek_v4)."""
    from ds4_vllm.model.config import Ds4Config, to_transformers_config

    path = tmp_path / "v4"
    path.mkdir()
    to_transformers_config(Ds4Config.from_pretrained(model_dir)).save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("deepseek_v4", ["DeepseekV4ForCausalLM"])
    return path


def test_register_is_idempotent() -> None:
    from vllm import ModelRegistry
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.transformers_utils.config import get_config_parser

    import ds4_vllm
    from ds4_vllm.model.config_parser import Ds4ConfigParser

    ds4_vllm.register()
    ds4_vllm._registered = False  # force the body to run again: must not raise
    ds4_vllm.register()
    assert "Ds4ForCausalLM" in ModelRegistry.get_supported_archs()
    assert isinstance(get_config_parser("ds4"), Ds4ConfigParser)
    with pytest.raises(ValueError, match="already registered"):  # registered, by vLLM's public answer
        KVConnectorFactory.register_connector("ds4disk", "unused", "Unused")


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


def test_offline_engine_args_resolve_ds4(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under HF_HUB_OFFLINE=1 vLLM maps names through get_model_path in EngineArgs.__post_init__."""
    import huggingface_hub
    from vllm.engine.arg_utils import EngineArgs

    monkeypatch.setenv("DS4_VLLM_CACHE", str(model_dir.parent.parent))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    args = EngineArgs(model="ds4", tokenizer="ds4")
    assert (args.model, args.tokenizer) == (str(model_dir), str(model_dir))


def test_deepseek_v4_checkpoint_with_config_format(model_dir: Path, v4_dir: Path) -> None:
    """A transformers `save_pretrained` dir (model_type deepseek_v4) + `--config-format ds4`."""
    from vllm.engine.arg_utils import EngineArgs

    from ds4_vllm.model.config import Ds4Config

    config = EngineArgs(
        model=str(v4_dir),
        tokenizer=str(model_dir),
        config_format="ds4",
        max_model_len=2048,
        load_format="dummy",
    ).create_engine_config()
    mc = config.model_config
    assert mc.architectures == ["Ds4ForCausalLM"]
    assert isinstance(mc.hf_config, Ds4Config) and mc.hf_config.model_type == "ds4"
    assert mc.hf_config.compress_ratios == [0, 0, 4, 128, 4, 128]
    assert not mc.use_mla
    assert config.cache_config.enable_prefix_caching  # not switched off as for deepseek_v4 on CPU


def test_config_format_reads_ds4_dirs_and_overrides_still_apply(model_dir: Path) -> None:
    from vllm.transformers_utils.config import get_config

    from ds4_vllm.model.config import Ds4Config

    config = get_config(
        model_dir, False, config_format="ds4", hf_overrides_kw={"max_position_embeddings": 4096}
    )
    assert isinstance(config, Ds4Config)
    assert config.max_position_embeddings == 4096
    assert config.name_or_path == str(model_dir)


def test_config_format_refuses_other_models(tmp_path: Path) -> None:
    from ds4_vllm.model.config_parser import Ds4ConfigParser

    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ValueError, match="--config-format ds4 reads DeepSeek V4 directories.*'llama'"):
        Ds4ConfigParser().parse(tmp_path, trust_remote_code=False)


def test_plugin_rewrites_vllm_serve_argv(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from ds4_vllm.vllm_compat.v0_32 import rewrite_sys_argv_for_serve

    monkeypatch.setenv("DS4_VLLM_CACHE", str(model_dir.parent.parent))
    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "--model", "ds4", "--kv-disk-dir", "/tmp/kv"])
    rewrite_sys_argv_for_serve()
    assert sys.argv[:4] == ["vllm", "serve", "--model", str(model_dir)]
    assert "--kv-transfer-config" in sys.argv and "--kv-disk-dir" not in sys.argv

    other = ["pytest", "--model", "ds4", "--kv-disk-dir", "/tmp/kv"]
    monkeypatch.setattr(sys, "argv", list(other))
    rewrite_sys_argv_for_serve()
    assert sys.argv == other  # only `vllm serve` command lines are touched


def test_plugin_argv_error_exits_like_argparse(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    from ds4_vllm.vllm_compat.v0_32 import rewrite_sys_argv_for_serve

    monkeypatch.setattr(sys, "argv", ["vllm", "serve", "m", "--tool-memory-max-ids", "0"])
    with pytest.raises(SystemExit) as exit_info:
        rewrite_sys_argv_for_serve()
    assert exit_info.value.code == 2
    assert "--tool-memory-max-ids / tool_memory_max_ids: must be >= 1, got 0" in capsys.readouterr().err


def test_ds4_vllm_serve_runs_vllm_cli_on_rewritten_args(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import vllm.entrypoints.cli.main as vllm_cli

    from ds4_vllm.cli.main import main

    seen: list[list[str]] = []
    monkeypatch.setenv("DS4_VLLM_CACHE", str(model_dir.parent.parent))
    monkeypatch.setattr(vllm_cli, "main", lambda: seen.append(list(sys.argv)))
    monkeypatch.setattr(sys, "argv", ["ds4-vllm"])
    main(["serve", "ds4", "--kv-connector", "ds4disk", "--kv-cache-min-tokens", "640", "--port", "8001"])
    [argv] = seen
    assert argv[:3] == ["ds4-vllm", "serve", str(model_dir)]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector_extra_config"] == {"kv_cache_min_tokens": 640}
    assert argv[argv.index("--served-model-name") + 1] == "ds4"


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), ([], 2), (["chat"], 2)])
def test_ds4_vllm_without_serve_prints_usage(argv: list[str], code: int, capsys) -> None:
    from ds4_vllm.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code
    out = capsys.readouterr()
    assert "usage: ds4-vllm serve" in (out.out if code == 0 else out.err)
    assert "--kv-cache-min-tokens N" in (out.out + out.err)


def test_the_config_loads_the_tokenizer_through_the_ds4_mode_without_a_regex_warning(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 24: VllmConfig loads the tokenizer for the reasoning parser's token ids while it is
    built; with mode "auto" that was transformers' loader, which printed "incorrect regex
    pattern" on every `ds4-vllm serve`. The mode is now chosen before that load."""
    import logging

    from vllm.engine.arg_utils import EngineArgs
    from vllm.tokenizers.registry import cached_get_tokenizer

    from ds4_vllm.serving.startup import PARSER_NAME

    monkeypatch.setenv("DS4_VLLM_CACHE", str(model_dir.parent.parent))
    cached_get_tokenizer.cache_clear()
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("transformers").addHandler(handler)
    try:
        config = EngineArgs(
            model="ds4", max_model_len=2048, reasoning_parser=PARSER_NAME
        ).create_engine_config()
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert config.model_config.tokenizer_mode == "ds4"
    assert config.reasoning_config is not None and config.reasoning_config.reasoning_end_token_ids
    assert not [m for m in messages if "incorrect regex" in m], messages
