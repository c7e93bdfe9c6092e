"""Flag parsing and validation: errors stop start-up and name the flag in both spellings."""

from __future__ import annotations

import dataclasses

import pytest

from ds4_vllm.store.options import (
    DEFAULT_BOUNDARY_ALIGN_TOKENS,
    SETTINGS,
    StoreConfigError,
    StoreOptions,
    default_disk_dir,
)


def test_defaults_are_ds4s() -> None:
    o = StoreOptions.from_extra_config({})
    assert (o.disk_space_mb, o.min_tokens, o.cold_max_tokens) == (4096, 512, 30000)
    assert (o.continued_interval_tokens, o.boundary_trim_tokens, o.boundary_align_tokens) == (10000, 32, 2048)
    assert (o.reject_different_quant, o.trace, o.tool_memory_max_ids) == (False, None, 100_000)
    assert o.budget_bytes == 4096 * 1024 * 1024
    assert DEFAULT_BOUNDARY_ALIGN_TOKENS == 2048


def test_default_dir_follows_xdg() -> None:
    assert default_disk_dir({"XDG_CACHE_HOME": "/c"}) == "/c/ds4-vllm/kvcache"
    assert default_disk_dir({}).endswith(".cache/ds4-vllm/kvcache")


def test_both_spellings_and_string_values() -> None:
    o = StoreOptions.from_extra_config(
        {
            "kv_disk_dir": "/tmp/x",
            "--kv-cache-min-tokens": "1024",
            "kv_cache_reject_different_quant": "true",
            "kv_disk_space_mb": 10,
            "trace": "/tmp/t.log",
            "--tool-memory-max-ids": "250",
        }
    )
    assert (o.disk_dir, o.min_tokens, o.reject_different_quant, o.disk_space_mb) == ("/tmp/x", 1024, True, 10)
    assert (o.trace, o.tool_memory_max_ids) == ("/tmp/t.log", 250)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"kv_cache_min_tokens": -1}, "--kv-cache-min-tokens / kv_cache_min_tokens: must be >= 1"),
        ({"kv_cache_min_tokens": 0}, "--kv-cache-min-tokens / kv_cache_min_tokens"),
        ({"kv_disk_space_mb": 0}, "--kv-disk-space-mb / kv_disk_space_mb"),
        (
            {"kv_cache_boundary_trim_tokens": -5},
            "--kv-cache-boundary-trim-tokens / kv_cache_boundary_trim_tokens",
        ),
        ({"kv_cache_min_tokens": 2.5}, "kv_cache_min_tokens: expected an integer, got 2.5"),
        ({"kv_cache_min_tokens": True}, "expected an integer"),
        ({"kv_cache_min_tokens": "lots"}, "expected an integer, got 'lots'"),
        ({"kv_cache_min_tokens": "--5"}, "expected an integer, got '--5'"),
        ({"kv_cache_min_tokens": "1_000"}, "expected an integer, got '1_000'"),
        ({"kv_cache_reject_different_quant": "maybe"}, "expected true or false"),
        ({"kv_cache_reject_different_quant": 1}, "expected true or false, got 1"),
        ({"kv_disk_dir": 5}, "--kv-disk-dir / kv_disk_dir: expected a path"),
        ({"kv_disk_dir": ""}, "--kv-disk-dir / kv_disk_dir: must not be empty"),
        ({"trace": ""}, "--trace / trace: must not be empty"),
        ({"kv_cache_min_tokns": 5}, "did you mean --kv-cache-min-tokens / kv_cache_min_tokens"),
        ({"bogus": 1}, "unknown disk-cache setting 'bogus'"),
        ({"tool_memory_max_ids": 0}, "--tool-memory-max-ids / tool_memory_max_ids: must be >= 1, got 0"),
        (
            {"--tool-memory-max-ids": "many"},
            "--tool-memory-max-ids / tool_memory_max_ids: expected an integer",
        ),
        (
            {"kv_cache_min_tokens": 1000, "kv_cache_cold_max_tokens": 900},
            "--kv-cache-cold-max-tokens / kv_cache_cold_max_tokens: 900 is below --kv-cache-min-tokens",
        ),
    ],
)
def test_invalid_values_name_the_flag(config: dict, message: str) -> None:
    with pytest.raises(StoreConfigError, match=_re(message)):
        StoreOptions.from_extra_config(config)
    assert issubclass(StoreConfigError, ValueError)


def test_boolean_and_integer_words() -> None:
    for word, value in [("TRUE", True), ("yes", True), ("on", True), ("0", False), ("off", False)]:
        assert (
            StoreOptions.from_extra_config({"kv_cache_reject_different_quant": word}).reject_different_quant
            is value
        )
    assert StoreOptions.from_extra_config({"kv_cache_min_tokens": " 640 "}).min_tokens == 640


def test_directly_built_options_are_checked_by_the_same_rules() -> None:
    with pytest.raises(
        StoreConfigError, match=_re("--kv-disk-space-mb / kv_disk_space_mb: must be >= 1, got 0")
    ):
        StoreOptions(disk_space_mb=0).validate()
    with pytest.raises(StoreConfigError, match=_re("--kv-disk-dir / kv_disk_dir: must not be empty")):
        StoreOptions(disk_dir="").validate()


def test_table_and_fields_match() -> None:
    """A new setting is one SETTINGS row plus one StoreOptions field (with a default)."""
    fields = {f.name for f in dataclasses.fields(StoreOptions)}
    assert sorted(s.field for s in SETTINGS.values()) == sorted(fields)


def test_legal_edges() -> None:
    o = StoreOptions.from_extra_config(
        {
            "kv_cache_cold_max_tokens": 0,
            "kv_cache_continued_interval_tokens": 0,
            "kv_cache_boundary_align_tokens": 0,
        }
    )
    assert o.cold_max_tokens == 0 and o.continued_step == 0
    assert StoreOptions.from_extra_config({"kv_cache_min_tokens": 100, "kv_cache_cold_max_tokens": 100})


def test_other_keys_are_passed_over() -> None:
    assert StoreOptions.from_extra_config({"model_layout": "x"}, other_keys=["model_layout"])


def _re(text: str) -> str:
    import re

    return re.escape(text)
