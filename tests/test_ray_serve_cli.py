"""`ds4-vllm ray-serve`: what its options turn into (no cluster; tests/ray/ deploys for real)."""

from __future__ import annotations

import json

import pytest

from ds4_vllm.cli.ray_serve import forwarded_env, llm_config, parse_args
from ds4_vllm.cli.vllm_args import ArgvError


def test_cache_flags_become_the_replicas_connector_config() -> None:
    spec, args = parse_args(
        ["/models/ds4", "--replicas", "3", "--kv-disk-dir", "s3://bucket/kv", "--kv-cache-rescan-ms=500"]
    )
    assert spec.model == "/models/ds4" and spec.replicas == 3 and args.app_name == "ds4"
    assert spec.kv_transfer_config == {
        "kv_connector": "ds4disk",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"kv_disk_dir": "s3://bucket/kv", "kv_cache_rescan_ms": 500},
    }


def test_llm_config_routes_by_prefix_and_keeps_ds4_serving_options(monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9000")
    spec, _ = parse_args(
        ["/models/ds4", "--kv-disk-dir", "/shared/kv", "--engine-kwargs", json.dumps({"dtype": "float32"})]
    )
    config = llm_config(spec)
    assert config.deployment_config["num_replicas"] == 2
    router = config.deployment_config["request_router_config"]["request_router_class"]
    assert router.__name__ == "Ds4PrefixRouter" and router.__mro__[1].__name__ == "PrefixCacheAffinityRouter"
    kwargs = config.engine_kwargs
    assert (kwargs["tool_call_parser"], kwargs["reasoning_parser"]) == ("ds4", "ds4")
    assert kwargs["enable_prompt_tokens_details"] is True and kwargs["dtype"] == "float32"
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"] == {"kv_disk_dir": "/shared/kv"}
    assert config.runtime_env["env_vars"]["AWS_ENDPOINT_URL"] == "http://127.0.0.1:9000"


def test_forwarded_env_takes_store_and_engine_variables_only() -> None:
    env = {"AWS_ACCESS_KEY_ID": "k", "PYTHONPATH": "/src", "VLLM_CPU_OMP_THREADS_BIND": "0", "HOME": "/root"}
    assert forwarded_env(env) == {
        "AWS_ACCESS_KEY_ID": "k",
        "PYTHONPATH": "/src",
        "VLLM_CPU_OMP_THREADS_BIND": "0",
    }


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kv-cache-rescan-ms", "soon"], "--kv-cache-rescan-ms / kv_cache_rescan_ms: expected an integer"),
        (["--replicas", "0"], "--replicas: must be >= 1, got 0"),
        (["--engine-kwargs", "[1]"], "--engine-kwargs: expected a JSON object"),
        (["--env", "NOVALUE"], "--env: expected KEY=VALUE, got 'NOVALUE'"),
    ],
)
def test_bad_options_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(ArgvError, match=message.replace("[", r"\[")):
        parse_args(["/models/ds4", *argv])


def test_token_id_prompts_get_a_prefix_key_and_text_keeps_ray_s() -> None:
    """Ray 2.60 keyed a token-id completion on "" and divided by zero (the request hung)."""
    from ds4_vllm.cli.ray_router import TOKEN_CHAR_BASE, Ds4PrefixRouter, token_ids_key

    router = Ds4PrefixRouter.__new__(Ds4PrefixRouter)  # the key functions need no routing state
    assert router._normalize_prompt_to_string([5, 0, 129279]) == "".join(
        chr(TOKEN_CHAR_BASE + t) for t in (5, 0, 129279)
    )
    assert router._normalize_prompt_to_string([5, 6]).startswith(router._normalize_prompt_to_string([5]))
    assert router._normalize_prompt_to_string("hello") == "hello"
    assert router._normalize_prompt_to_string([{"role": "user", "content": "hi"}]) == "hi"
    assert token_ids_key([]) is None and token_ids_key(["a"]) is None and token_ids_key([-1]) is None


def test_cpu_tensor_parallel_replicas_are_not_pinned_to_the_launchers_cores(monkeypatch) -> None:
    """On CPU, 2 ranks per replica need `VLLM_CPU_OMP_THREADS_BIND` (cpu_parallel.py); replicas
    share nodes, so they get "nobind" rather than one core list for all; a user's value is kept."""
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("ds4_vllm.cli.ray_serve._has_gpu", lambda: False)
    spec, _ = parse_args(["/models/ds4", "--engine-kwargs", json.dumps({"tensor_parallel_size": 2})])
    assert llm_config(spec).runtime_env["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    spec, _ = parse_args(["/models/ds4", "--engine-kwargs", json.dumps({"tensor_parallel_size": 2})])
    assert llm_config(spec).runtime_env["env_vars"]["VLLM_CPU_OMP_THREADS_BIND"] == "0|1"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    spec, _ = parse_args(["/models/ds4"])
    assert "VLLM_CPU_OMP_THREADS_BIND" not in llm_config(spec).runtime_env["env_vars"]
