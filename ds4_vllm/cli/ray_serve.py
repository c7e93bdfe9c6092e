"""`ds4-vllm ray-serve`: ds4 with the ds4disk connector as a Ray Serve LLM app on an existing cluster.

Ray is the engine here: this module only fills in Ray Serve LLM's `LLMConfig` and deploys
`build_openai_app` on a cluster started with `ray start --head` / `ray start --address=...`.
N replicas of one vLLM engine each share one checkpoint store (`--kv-disk-dir DIR` on a
filesystem every node sees, or `s3://bucket/prefix`); Ray's `PrefixCacheAffinityRouter` (as `ray_router.Ds4PrefixRouter`) sends
the turns of a conversation to the replica that served its prefix, any other replica loads
the prefix from the store. See docs/ray.md.

What of ds4-vllm applies under Ray Serve LLM's OpenAI app (its own FastAPI ingress, not
`vllm serve`): everything inside the engine (the model, the ds4disk connector and its store,
tokenizer mode `ds4` and `Ds4Renderer`, picked by the plugin from the architecture) and the
frontend options Ray passes to vLLM's serving classes (`--tool-call-parser ds4`,
`--reasoning-parser ds4`, `enable_prompt_tokens_details`, so `usage.prompt_tokens_details.
cached_tokens` reports memory and disk hits together). What does not: `vllm serve` middleware
and routes (the raw-body middleware, so rendering works from the parsed messages; the
`prompt_cache_*` usage fields; GET /v1/kv_cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from ds4_vllm.cli.cpu_parallel import tensor_parallel_env
from ds4_vllm.cli.vllm_args import KV_CACHE_FLAGS, ArgvError, rewrite_kv_connector_args

#: Variables of the launching shell that replicas get through `runtime_env` (Ray workers do not
#: inherit the driver's environment): object-store credentials/endpoint, our cache folders,
#: vLLM and Hugging Face settings, and the import path.
FORWARDED_ENV_PREFIXES = ("AWS_", "FSSPEC_", "DS4_VLLM_", "VLLM_", "HF_")
FORWARDED_ENV_NAMES = ("PYTHONPATH", "XDG_CACHE_HOME", "OMP_NUM_THREADS")
#: The parser name of `ds4_vllm.serving.parsers` (not imported here: it imports vLLM).
PARSER_NAME = "ds4"
DEFAULT_APP_NAME = "ds4"
DEFAULT_REPLICAS = 2


@dataclasses.dataclass(frozen=True)
class RayServeSpec:
    """What one `ds4-vllm ray-serve` deploys: the model, how many replicas, the store, the engine."""

    model: str
    served_model_name: str = "ds4"
    replicas: int = DEFAULT_REPLICAS
    kv_transfer_config: Mapping[str, Any] | None = None
    engine_kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    prefix_routing: bool = True
    replica_cpus: float = 1.0


def forwarded_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The launching shell's variables that replicas need (see FORWARDED_ENV_PREFIXES)."""
    environ = os.environ if environ is None else environ
    return {
        k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES) or k in FORWARDED_ENV_NAMES
    }


def engine_kwargs(spec: RayServeSpec) -> dict[str, Any]:
    """vLLM arguments of every replica: ds4's frontend options, the connector, the user's extras."""
    out: dict[str, Any] = {
        "enable_auto_tool_choice": True,
        "tool_call_parser": PARSER_NAME,
        "reasoning_parser": PARSER_NAME,
        "enable_prompt_tokens_details": True,
    }
    if spec.kv_transfer_config is not None:
        out["kv_transfer_config"] = dict(spec.kv_transfer_config)
    out.update(spec.engine_kwargs)
    return out


def llm_config(spec: RayServeSpec):
    """Ray Serve LLM's `LLMConfig` for the spec (CPU or GPU is Ray's choice from the cluster)."""
    from ray.serve.llm import LLMConfig

    deployment: dict[str, Any] = {
        "num_replicas": spec.replicas,
        "ray_actor_options": {"num_cpus": spec.replica_cpus},
    }
    if spec.prefix_routing:
        from .ray_router import Ds4PrefixRouter

        deployment["request_router_config"] = {"request_router_class": Ds4PrefixRouter}
    kwargs = engine_kwargs(spec)
    gpu = _has_gpu()
    env = dict(spec.env)
    if not gpu:  # tensor parallel on CPU: vLLM's mp executor (Ray Serve LLM's choice), threads unpinned
        env.update(tensor_parallel_env(int(kwargs.get("tensor_parallel_size", 1)), env, pin_cores=False))
    return LLMConfig(
        model_loading_config={"model_id": spec.served_model_name, "model_source": spec.model},
        accelerator_config={"kind": "gpu" if gpu else "cpu"},
        engine_kwargs=kwargs,
        deployment_config=deployment,
        runtime_env={"env_vars": env},
    )


def build_app(spec: RayServeSpec):
    """Ray Serve LLM's OpenAI app (its ingress parses request bodies before the router sees them)."""
    from ray.serve.llm import build_openai_app

    return build_openai_app({"llm_configs": [llm_config(spec)]})


def _has_gpu() -> bool:
    """GPU replicas when the launching node has an NVIDIA driver (as the README's set-up decides)."""
    import shutil

    return shutil.which("nvidia-smi") is not None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ds4-vllm ray-serve",
        description="Deploy ds4 with the ds4disk connector on an existing Ray cluster (docs/ray.md). "
        "The ds4 cache flags (`ds4-vllm --help`) are accepted as for `ds4-vllm serve`.",
    )
    p.add_argument("model", nargs="?", default="ds4", help="model directory, GGUF file or `ds4` (default)")
    p.add_argument("--served-model-name", default="ds4")
    p.add_argument("--replicas", type=int, default=DEFAULT_REPLICAS, help="engine replicas (default 2)")
    p.add_argument("--address", default="auto", help="Ray cluster address (default: the local node's)")
    p.add_argument("--app-name", default=DEFAULT_APP_NAME)
    p.add_argument("--route-prefix", default="/")
    p.add_argument("--host", default="127.0.0.1", help="Serve HTTP host (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="Serve HTTP port (default 8000)")
    p.add_argument("--replica-cpus", type=float, default=1.0, help="logical CPUs Ray reserves per replica")
    p.add_argument(
        "--engine-kwargs",
        default="{}",
        help='more vLLM engine arguments as JSON, e.g. \'{"max_model_len": 8192, "dtype": "float32"}\'',
    )
    p.add_argument(
        "--no-prefix-routing",
        action="store_true",
        help="Ray's default router instead of the prefix-aware one (Ds4PrefixRouter)",
    )
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra replica variable")
    return p


def parse_args(argv: Sequence[str]) -> tuple[RayServeSpec, argparse.Namespace]:
    """The spec and the run options; unknown flags must be ds4 cache flags (else ArgvError)."""
    cache_flags, own = split_cache_flags(argv)
    args = _parser().parse_args(own)
    if args.replicas < 1:
        raise ArgvError(f"--replicas: must be >= 1, got {args.replicas}")
    try:
        extra_engine = json.loads(args.engine_kwargs)
    except json.JSONDecodeError as e:
        raise ArgvError(f"--engine-kwargs: not JSON: {e}") from None
    if not isinstance(extra_engine, dict):
        raise ArgvError(f"--engine-kwargs: expected a JSON object, got {args.engine_kwargs!r}")
    env = forwarded_env()
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ArgvError(f"--env: expected KEY=VALUE, got {item!r}")
        env[key] = value
    spec = RayServeSpec(
        model=_model_path(args.model),
        served_model_name=args.served_model_name,
        replicas=args.replicas,
        kv_transfer_config=_kv_transfer_config(cache_flags),
        engine_kwargs=extra_engine,
        env=env,
        prefix_routing=not args.no_prefix_routing,
        replica_cpus=args.replica_cpus,
    )
    return spec, args


def split_cache_flags(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the ds4 cache flags and `--kv-connector` with their values, every other argument)."""
    from ds4_vllm.store.options import setting_for

    cache: list[str] = []
    own: list[str] = []
    argv = list(argv)
    i = 0
    while i < len(argv):
        flag, eq, _ = argv[i].partition("=")
        if flag not in KV_CACHE_FLAGS and flag != "--kv-connector":
            own.append(argv[i])
            i += 1
            continue
        takes_value = flag == "--kv-connector" or setting_for(KV_CACHE_FLAGS[flag]).kind is not bool
        if not eq and takes_value and i + 1 < len(argv):
            cache += argv[i : i + 2]
            i += 2
        else:
            cache.append(argv[i])
            i += 1
    return cache, own


def _kv_transfer_config(cache_flags: list[str]) -> dict[str, Any]:
    """The ds4 cache flags as one kv_transfer_config (ds4disk when no flag is given), via the
    same rewrite as `ds4-vllm serve`, so values, checks and messages agree."""
    out = rewrite_kv_connector_args(["serve", "model", *(cache_flags or ["--kv-connector", "ds4disk"])])
    return json.loads(out[out.index("--kv-transfer-config") + 1])


def _model_path(model: str) -> str:
    if model == "ds4":
        from ds4_vllm.model.default_model import default_model_dir

        return str(default_model_dir())
    return os.path.abspath(os.path.expanduser(model)) if os.path.exists(os.path.expanduser(model)) else model


def main(argv: Sequence[str] | None = None) -> None:
    """Connect to the cluster, deploy (or update) the app, wait until it is running, and return.

    The app keeps running on the cluster after this command exits; `serve shutdown` or
    `serve delete APP` removes it.
    """
    try:
        spec, args = parse_args(sys.argv[1:] if argv is None else argv)
    except ArgvError as e:
        sys.stderr.write(f"ds4-vllm ray-serve: error: {e}\n")
        raise SystemExit(2) from None
    try:
        import ray
        from ray import serve
    except ImportError:
        sys.stderr.write("ds4-vllm ray-serve: Ray Serve is not installed: pip install -e '.[ray]'\n")
        raise SystemExit(2) from None
    ray.init(address=args.address, runtime_env={"env_vars": dict(spec.env)})
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(build_app(spec), name=args.app_name, route_prefix=args.route_prefix, blocking=False)
    print(
        f"ds4-vllm ray-serve: app {args.app_name!r} running: {spec.replicas} replica(s) of "
        f"{spec.served_model_name!r} at http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}/v1",
        flush=True,
    )


if __name__ == "__main__":
    main()
