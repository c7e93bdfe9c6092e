"""The `vllm serve` argv rewrites (pure functions, no vLLM import) and their one flag table."""

import json
import os
import re

import pytest

from ds4_vllm.cli.vllm_args import (
    KV_CACHE_FLAGS,
    ArgvError,
    mentions_default_model,
    rewrite_kv_connector_args,
    rewrite_model_arg,
    rewrite_serve_argv,
)
from ds4_vllm.store.options import SETTINGS, StoreConfigError, StoreOptions

MODEL_DIR = "/cache/ds4-tiny"
#: The ds4 engine answers to deepseek-v4-flash (its /v1/models id), deepseek-chat and deepseek-reasoner.
SERVED = ["--served-model-name", "ds4", "deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner"]


def _kv_config(argv: list[str]) -> dict:
    idx = argv.index("--kv-transfer-config")
    return json.loads(argv[idx + 1])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["serve", "--model", "ds4", "--port", "8000"],
            ["serve", "--model", MODEL_DIR, "--port", "8000", *SERVED],
        ),
        (["serve", "--model=ds4"], ["serve", f"--model={MODEL_DIR}", *SERVED]),
        (
            ["serve", "ds4", "--host", "127.0.0.1"],
            ["serve", MODEL_DIR, "--host", "127.0.0.1", *SERVED],
        ),
        (
            ["serve", "--host", "127.0.0.1", "--model", "ds4", "--served-model-name", "x"],
            ["serve", "--host", "127.0.0.1", "--model", MODEL_DIR, "--served-model-name", "x"],
        ),
    ],
)
def test_default_model_is_resolved(argv: list[str], expected: list[str]) -> None:
    assert mentions_default_model(argv)
    assert rewrite_model_arg(argv, MODEL_DIR) == expected


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--model", "/models/ds4"],
        ["serve", "./ds4"],
        ["serve", "deepseek-ai/DeepSeek-V4-Flash"],
        ["bench", "--model", "ds4"],
        ["serve", "--port", "8000"],
        [],
    ],
)
def test_other_models_untouched(argv: list[str]) -> None:
    assert not mentions_default_model(argv)
    assert rewrite_model_arg(argv, MODEL_DIR) == argv


def test_model_flag_without_value() -> None:
    with pytest.raises(ArgvError, match="--model needs a value"):
        mentions_default_model(["serve", "--model"])


def test_rewrite_is_idempotent() -> None:
    once = rewrite_serve_argv(["serve", "--model", "ds4", "--kv-disk-dir", "/tmp/kv"], lambda: MODEL_DIR)
    assert rewrite_serve_argv(once, lambda: MODEL_DIR) == once


def test_model_dir_only_materialized_when_needed() -> None:
    def boom() -> str:
        raise AssertionError("should not be called")

    assert rewrite_serve_argv(["serve", "/models/x"], boom) == ["serve", "/models/x"]
    assert rewrite_serve_argv(["chat"], boom) == ["chat"]


def test_kv_connector_with_ds4_engine_flags() -> None:
    """ds4's own flags; test_every_setting_is_a_flag covers the rest of the table."""
    argv = [
        "serve",
        "m",
        "--kv-connector",
        "ds4disk",
        "--kv-disk-dir",
        "/tmp/kv",
        "--kv-disk-space-mb=2048",
        "--kv-cache-min-tokens",
        "512",
        "--kv-cache-cold-max-tokens",
        "30000",
        "--kv-cache-continued-interval-tokens",
        "10000",
        "--kv-cache-boundary-trim-tokens",
        "32",
        "--kv-cache-boundary-align-tokens",
        "2048",
        "--kv-cache-reject-different-quant",
        "--trace",
        "/tmp/trace.txt",
        "--port",
        "8001",
    ]
    out = rewrite_kv_connector_args(argv)
    assert out[:2] == ["serve", "m"]
    assert "--port" in out and out[out.index("--port") + 1] == "8001"
    assert not any(
        a.startswith(("--kv-disk", "--kv-cache-", "--trace", "--tool-memory", "--kv-connector")) for a in out
    )
    assert _kv_config(out) == {
        "kv_connector": "ds4disk",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",  # ds4disk requires it: a failed load is recomputed
        "kv_connector_extra_config": {
            "kv_disk_dir": "/tmp/kv",
            "kv_disk_space_mb": 2048,
            "kv_cache_min_tokens": 512,
            "kv_cache_cold_max_tokens": 30000,
            "kv_cache_continued_interval_tokens": 10000,
            "kv_cache_boundary_trim_tokens": 32,
            "kv_cache_boundary_align_tokens": 2048,
            "kv_cache_reject_different_quant": True,
            "trace": "/tmp/trace.txt",
        },
    }


def test_connector_name_alone_and_relative_path() -> None:
    out = rewrite_kv_connector_args(["serve", "m", "--kv-connector=other"])
    assert _kv_config(out) == {"kv_connector": "other", "kv_role": "kv_both", "kv_connector_extra_config": {}}
    assert _kv_config(rewrite_kv_connector_args(["serve", "m", "--kv-connector=ds4disk"]))[
        "kv_load_failure_policy"
    ] == ("recompute")
    out = rewrite_kv_connector_args(["serve", "m", "--kv-disk-dir", "kvdir"])
    cfg = _kv_config(out)
    assert cfg["kv_connector"] == "ds4disk"  # cache flags imply the ds4 disk connector
    assert cfg["kv_connector_extra_config"]["kv_disk_dir"] == os.path.abspath("kvdir")


def test_bool_flag_explicit_false() -> None:
    out = rewrite_kv_connector_args(["serve", "m", "--kv-cache-reject-different-quant=false"])
    assert _kv_config(out)["kv_connector_extra_config"] == {"kv_cache_reject_different_quant": False}


def test_no_kv_flags_unchanged() -> None:
    argv = ["serve", "m", "--kv-transfer-config", '{"kv_connector": "x"}']
    assert rewrite_kv_connector_args(argv) == argv


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "m", "--kv-disk-dir"], "--kv-disk-dir / kv_disk_dir: expected a path, got no value"),
        (["serve", "m", "--kv-disk-dir", "--port", "1"], "--kv-disk-dir / kv_disk_dir: expected a path"),
        (["serve", "m", "--kv-disk-dir="], "--kv-disk-dir / kv_disk_dir: must not be empty"),
        (["serve", "m", "--trace"], "--trace / trace: expected a path, got no value"),
        (
            ["serve", "m", "--kv-disk-space-mb", "lots"],
            "--kv-disk-space-mb / kv_disk_space_mb: expected an integer, got 'lots'",
        ),
        (
            ["serve", "m", "--kv-cache-min-tokens=-1"],
            "--kv-cache-min-tokens / kv_cache_min_tokens: must be >= 1, got -1",
        ),
        (["serve", "m", "--kv-cache-min-tokens", "0"], "must be >= 1, got 0"),
        (["serve", "m", "--kv-cache-boundary-trim-tokens=-3"], "must be >= 0, got -3"),
        (
            ["serve", "m", "--kv-cache-reject-different-quant=maybe"],
            "--kv-cache-reject-different-quant / kv_cache_reject_different_quant: expected true or false",
        ),
        (
            ["serve", "m", "--tool-memory-max-ids", "0"],
            "--tool-memory-max-ids / tool_memory_max_ids: must be >= 1, got 0",
        ),
        (
            ["serve", "m", "--kv-cache-min-tokens", "1000", "--kv-cache-cold-max-tokens", "900"],
            "--kv-cache-cold-max-tokens / kv_cache_cold_max_tokens: 900 is below --kv-cache-min-tokens",
        ),
        (["serve", "m", "--kv-connector"], "--kv-connector needs"),
        (["serve", "m", "--kv-connector="], "--kv-connector needs a connector name"),
        (["serve", "m", "--kv-disk-dir", "/x", "--kv-transfer-config", "{}"], "cannot be combined"),
        (
            ["serve", "m", "--kv-connector", "a", "--kv-transfer-config.kv_role", "kv_both"],
            "cannot be combined",
        ),
    ],
)
def test_errors_are_clear(argv: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match=re.escape(message)):
        rewrite_kv_connector_args(argv)


def test_every_setting_is_a_flag() -> None:
    """The flags come from store/options.py's table: a new setting needs no change here."""
    assert sorted(KV_CACHE_FLAGS.values()) == sorted(SETTINGS)
    assert all(flag == "--" + key.replace("_", "-") for flag, key in KV_CACHE_FLAGS.items())


@pytest.mark.parametrize(
    ("key", "raw"),
    [
        ("kv_disk_space_mb", "0"),
        ("kv_cache_min_tokens", "-1"),
        ("kv_cache_min_tokens", "1_000"),
        ("kv_cache_boundary_align_tokens", "x"),
        ("kv_cache_reject_different_quant", "maybe"),
        ("kv_disk_dir", ""),
    ],
)
def test_flag_and_extra_config_reject_alike(key: str, raw: str) -> None:
    """Both spellings go through one parser: same rejection, same message."""
    with pytest.raises(StoreConfigError) as from_config:
        StoreOptions.from_extra_config({key: raw})
    flag = "--" + key.replace("_", "-")
    with pytest.raises(ArgvError) as from_flag:
        rewrite_kv_connector_args(["serve", "m", f"{flag}={raw}"])
    assert str(from_flag.value) == str(from_config.value)


def test_urls_are_not_made_absolute() -> None:
    out = rewrite_kv_connector_args(["serve", "m", "--kv-disk-dir", "s3://bucket/kv", "--trace=~/t.log"])
    extra = _kv_config(out)["kv_connector_extra_config"]
    assert extra == {"kv_disk_dir": "s3://bucket/kv", "trace": os.path.expanduser("~/t.log")}


def test_other_connector_gets_flags_unchecked_together() -> None:
    """Cross-setting checks are ds4disk's; another connector receives the parsed values as given."""
    argv = [
        "serve",
        "m",
        "--kv-connector",
        "mine",
        "--kv-cache-min-tokens=1000",
        "--kv-cache-cold-max-tokens=900",
    ]
    extra = _kv_config(rewrite_kv_connector_args(argv))["kv_connector_extra_config"]
    assert extra == {"kv_cache_min_tokens": 1000, "kv_cache_cold_max_tokens": 900}


def test_ds4disk_gets_a_shutdown_drain_unless_given() -> None:
    """SIGTERM with vLLM's default 0 s kills the engine at once; ds4disk needs time to save."""
    out = rewrite_kv_connector_args(["serve", "m", "--kv-connector", "ds4disk"])
    assert out[out.index("--shutdown-timeout") + 1] == "5"
    out = rewrite_kv_connector_args(["serve", "m", "--kv-connector", "ds4disk", "--shutdown-timeout", "20"])
    assert out.count("--shutdown-timeout") == 1 and out[out.index("--shutdown-timeout") + 1] == "20"
    assert "--shutdown-timeout" not in rewrite_kv_connector_args(["serve", "m", "--kv-connector", "other"])


# -- `ds4-vllm serve` defaults (issue 24) ---------------------------------------------------------


def test_serve_with_no_flags_is_the_product() -> None:
    from ds4_vllm.cli.vllm_args import apply_serve_defaults

    assert apply_serve_defaults(["serve"]) == ["serve", "ds4", "--kv-connector", "ds4disk"]
    assert apply_serve_defaults(["serve", "--port", "8001"]) == [
        "serve",
        "ds4",
        "--port",
        "8001",
        "--kv-connector",
        "ds4disk",
    ]
    assert apply_serve_defaults(["serve", "ds4-tiny-q2"])[-2:] == ["--kv-connector", "ds4disk"]


def test_serve_defaults_keep_what_the_user_chose() -> None:
    from ds4_vllm.cli.vllm_args import apply_serve_defaults

    for given in (
        ["serve", "ds4", "--kv-disk-dir", "/x"],
        ["serve", "--kv-connector=ds4disk"],
        ["serve", "--model", "ds4", "--kv-transfer-config", "{}"],
        ["serve", "ds4", "--kv-transfer-config.kv_connector", "x"],
        ["serve", "ds4", "--kv-cache-min-tokens=64"],
    ):
        assert "ds4disk" not in apply_serve_defaults(given)[len(given) :], given
    # Another model: no ds4disk (it checkpoints ds4 models only).
    assert apply_serve_defaults(["serve", "Qwen/Qwen3-0.6B"]) == ["serve", "Qwen/Qwen3-0.6B"]
    # Plain `vllm serve` has no defaults (the plugin rewrite does not call this).
    assert apply_serve_defaults(["chat"]) == ["chat"]


def test_no_kv_disk_serves_without_checkpoints_and_refuses_contradictions() -> None:
    from ds4_vllm.cli.vllm_args import ArgvError, apply_serve_defaults

    assert apply_serve_defaults(["serve", "--no-kv-disk"]) == ["serve", "ds4"]
    with pytest.raises(ArgvError, match="--no-kv-disk serves without checkpoints"):
        apply_serve_defaults(["serve", "--no-kv-disk", "--kv-disk-dir", "/x"])
