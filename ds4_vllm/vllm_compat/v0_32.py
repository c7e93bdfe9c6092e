"""vLLM 0.32.x: the patches ds4-vllm still needs, each with the reason no public hook does it.

1. The model name `ds4`. vLLM has no hook for resolving model names (a model is a local path,
   a hub id or a cloud URI). `EngineArgs.__post_init__` loads plugins and then, under
   HF_HUB_OFFLINE=1, maps names through `arg_utils.get_model_path`; `create_engine_config`
   reads the config (speculator check, then ModelConfig). We wrap both so `LLM(model="ds4")`
   and `EngineArgs(model="ds4")` mean the default model directory. (The first EngineArgs is
   already inside `__post_init__` when plugins load, so wrapping `__post_init__` would miss it.)
2. `vllm serve` flags. vLLM's CLI has a fixed list of subcommands and no hook for plugin flags,
   but it loads general plugins while building the `serve` parser
   (`AsyncEngineArgs.add_cli_args`), before `FlexibleArgumentParser.parse_args` reads
   `sys.argv`. The launching process rewrites `sys.argv` there (`ds4_vllm.cli.vllm_args`), so
   `vllm serve --model ds4 --kv-connector ds4disk --kv-disk-dir D` works. `ds4-vllm serve`
   applies the same rewrite without depending on this.
3. The tokenizer of a transformers-saved DeepSeek V4 directory. vLLM's tokenizer loader reads
   the tokenizer directory's config with the "hf" format whatever `--config-format` says, and
   vLLM's own `DeepseekV4Config` rejects transformers' form (`mlp_layer_types` hash_moe/moe)
   with an error the loader does not catch. We wrap the loader's `get_config` so that such a
   directory (and only such a directory) is read as `--config-format ds4` reads it.
4. A GGUF file as `--model`. Before any config format applies, `create_engine_config` asks
   transformers whether the model is a speculators checkpoint by parsing the model path as a
   JSON config. A ds4 GGUF file is not one; we skip that check for GGUF files only (the GGUF
   config, load format and tokenizer come through public hooks, `ds4_vllm.model.gguf_serving`).
5. Usage on every response. vLLM's serving code drops what the engine reports per request
   (`RequestOutput.num_cached_tokens` for some routes and flags, `kv_transfer_params`, where the
   ds4disk connector says how many tokens came from disk, for streams and `/v1/responses`).
   We wrap `AsyncLLM.generate` in the API server so each output is also noted for the HTTP
   request being served (`ds4_vllm.serving.request_outputs`); the `--middleware` that
   `vllm serve` gets from the argv rewrite writes the usage fields from it. The same hook feeds
   each finished sequence to the text-keyed reuse of the engine client's serving state.
6. `GET /v1/kv_cache` with no flags. vLLM loads `vllm.endpoint_plugins` only when
   `VLLM_PLUGINS` names them. When `VLLM_PLUGINS` is unset we add ds4's own endpoint plugin
   (and only it) to `load_endpoint_plugins`' answer, without vLLM's warning that a found
   endpoint plugin is not allowlisted (still given for other packages' plugins); when it is set,
   vLLM's rule applies and it must name `ds4` (which also loads the general plugin, this one).
7. The ds4 tokenizer mode for `Ds4ForCausalLM`. vLLM picks a tokenizer mode by architecture
   only for its own models, after plugins ran. The wrapped `create_model_config` sets
   `tokenizer_mode` "ds4" (our registered tokenizer and renderer) when it is "auto" and the
   architecture is ours, before `VllmConfig` loads the tokenizer (otherwise transformers' own
   loader runs once and prints its false "incorrect regex pattern" warning). The renderer overrides `BaseRenderer._render_prompt_async` to wrap
   `/v1/completions` text prompts as the ds4 engine does (no public hook renders them).
8. Seeded sampling over a chunked prefill. Every scheduled row is sampled, also a request whose
   prefill is only partly done; its token is discarded, and `_bookkeeping_sync` then rewinds the
   request's generator with `generator.set_offset(offset - 4)`, which only CUDA generators
   implement: on the CPU a request with `seed` and a prompt longer than one chunk killed the
   engine ("CPU Generator does not use offset"). We wrap `GPUModelRunner.sample_tokens` so the
   discarded rows' generators are taken out of the batch's `generators` while that step samples
   (those rows draw from the global generator; their tokens are thrown away) and put back
   after. The per-request generator then advances only for tokens the request keeps, on every
   device, so the same seed gives the same tokens whatever the chunk size, and a prompt
   restored from disk (fewer prefill chunks) samples what the cold run samples.
9. The compile cache on the CPU. There vLLM compiles the model body (`Ds4CompiledBody`) in its
   DYNAMO_TRACE_ONCE mode with the plain "inductor" backend, saves an AOT artifact, and at the
   next start cannot load it ("'function' object has no attribute 'finalize_loading'", logged
   as a warning) and compiles again. On the CPU, unless `VLLM_USE_AOT_COMPILE` is set, we set it
   to 0: no futile save and no warning; Inductor's own caches still shorten a second start.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import sys
from typing import Any

#: Every vLLM name this module patches or relies on privately, with what it does with it.
PATCHED_NAMES: dict[str, str] = {
    "vllm.engine.arg_utils.EngineArgs.create_engine_config": (
        "wrapped: resolves the model (and tokenizer) name `ds4` before vLLM reads a config"
    ),
    "vllm.engine.arg_utils.EngineArgs.create_model_config": (
        "wrapped: selects tokenizer mode `ds4` for Ds4ForCausalLM before VllmConfig loads the tokenizer"
    ),
    "vllm.engine.arg_utils.get_model_path": (
        "module global replaced: EngineArgs.__post_init__ calls it under HF_HUB_OFFLINE=1"
    ),
    "vllm.engine.arg_utils.AsyncEngineArgs.add_cli_args": (
        "relied on: loads general plugins while `vllm serve` builds its parser"
    ),
    "vllm.engine.arg_utils.load_general_plugins": "relied on: the call above",
    "vllm.utils.argparse_utils.FlexibleArgumentParser.parse_args": (
        "relied on: parses sys.argv[1:] (rewritten by the plugin) after plugins loaded"
    ),
    "vllm.engine.arg_utils.maybe_override_with_speculators": (
        "module global replaced: skipped for a GGUF model file, which is not a JSON config"
    ),
    "vllm.tokenizers.registry.get_config": (
        "module global replaced: the tokenizer loader reads transformers' DeepSeek V4 dirs as ds4"
    ),
    "vllm.v1.engine.async_llm.AsyncLLM.generate": (
        "wrapped: notes each RequestOutput for the HTTP request being served (usage fields) "
        "and each finished sequence for text-keyed reuse"
    ),
    "vllm.plugins.load_endpoint_plugins": (
        "module global replaced: adds ds4's /v1/kv_cache plugin when VLLM_PLUGINS is unset"
    ),
    "vllm.renderers.base.BaseRenderer._render_prompt_async": (
        "relied on: Ds4Renderer overrides it (and render_prompt) to wrap /v1/completions prompts"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner.sample_tokens": (
        "wrapped: hides the generators of rows whose sampled token is discarded (see item 8)"
    ),
    "vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm": (
        "relied on: ds4_vllm.model.cpu_kernels binds vLLM's CPU GEMM to the model's float projections"
    ),
    "vllm.envs.VLLM_USE_AOT_COMPILE": (
        "environment default set to 0 on the CPU: its AOT artifacts do not load back (see item 9)"
    ),
    "vllm.v1.worker.gpu_model_runner.GPUModelRunner._bookkeeping_sync": (
        "relied on: rewinds discarded rows' generators with CUDA-only set_offset (see item 8)"
    ),
}

#: Public vLLM names ds4-vllm uses; checked with PATCHED_NAMES so an upgrade shows all breaks.
PUBLIC_NAMES: tuple[str, ...] = (
    "vllm.ModelRegistry.register_model",
    "vllm.ModelRegistry.get_supported_archs",
    "vllm.distributed.kv_transfer.kv_connector.factory.KVConnectorFactory.register_connector",
    "vllm.transformers_utils.config.register_config_parser",
    "vllm.transformers_utils.config.get_config_parser",
    "vllm.transformers_utils.config_parser_base.ConfigParserBase",
    "vllm.engine.arg_utils.EngineArgs.config_format",
    "vllm.engine.arg_utils.EngineArgs.tokenizer",
    "vllm.engine.arg_utils.EngineArgs.served_model_name",
    "vllm.engine.arg_utils.EngineArgs.kv_cache_memory_bytes",
    "vllm.config.kv_transfer.KVTransferConfig.kv_load_failure_policy",
    "vllm.entrypoints.cli.main.main",
    # the ds4disk connector
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1.build_connector_worker_meta",
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorBase_V1.requires_kv_delivery",
    "vllm.distributed.kv_transfer.kv_connector.v1.base.KVConnectorWorkerMetadata",
    "vllm.distributed.kv_transfer.kv_connector.v1.base.SupportsHMA",
    "vllm.v1.outputs.KVConnectorOutput.kv_connector_worker_meta",
    "vllm.forward_context.ForwardContext",  # its declared field additional_kwargs carries StepHidden
    "vllm.forward_context.is_forward_context_available",
    "vllm.engine.arg_utils.EngineArgs.shutdown_timeout",  # SIGTERM drain: time for shutdown saves
    # usage fields and /v1/kv_cache (ds4_vllm.serving)
    "vllm.outputs.RequestOutput",  # num_cached_tokens, prompt_token_ids, final kv_transfer_params
    "vllm.plugins.endpoint_plugins.interface.EndpointPlugin",
    "vllm.entrypoints.launchers.cli_args.FrontendArgs",  # its `middleware` field: --middleware
    # the ds4 tokenizer and renderer (ds4_vllm.serving)
    "vllm.tokenizers.registry.TokenizerRegistry",
    "vllm.renderers.registry.RENDERER_REGISTRY",
    "vllm.renderers.base.BaseRenderer.render_messages_async",
    "vllm.tokenizers.hf.get_cached_tokenizer",
    "vllm.config.model.ModelConfig.architecture",
)

_PATCHED_MARK = "_ds4_patched"


def apply() -> None:
    """Install the patches (idempotent: vLLM loads plugins once per process, tests more often)."""
    resolve_default_model_name()
    rewrite_sys_argv_for_serve()
    read_deepseek_v4_tokenizer_dirs_as_ds4()
    record_request_outputs()
    load_ds4_endpoint_plugin_by_default()
    keep_generators_of_discarded_rows()
    skip_cpu_aot_compile_cache()


def resolve_default_model_name() -> None:
    """Make `LLM(model="ds4")` and any `EngineArgs(model="ds4")` use the default model directory."""
    from vllm.engine import arg_utils

    if getattr(arg_utils.EngineArgs.create_engine_config, _PATCHED_MARK, False):
        return
    original_create = arg_utils.EngineArgs.create_engine_config
    original_model_config = arg_utils.EngineArgs.create_model_config
    original_get_model_path = arg_utils.get_model_path
    original_speculators = arg_utils.maybe_override_with_speculators

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        from ds4_vllm.model.embedded import resolve_default_model

        resolve_default_model(self)
        return original_create(self, *args, **kwargs)

    @functools.wraps(original_model_config)
    def create_model_config(self: Any) -> Any:
        from ds4_vllm.serving.startup import select_tokenizer_mode

        # Before VllmConfig exists: its __post_init__ already loads the tokenizer (the reasoning
        # config's token ids), and with mode "auto" that would be transformers' loader.
        model_config = original_model_config(self)
        select_tokenizer_mode(model_config)
        return model_config

    @functools.wraps(original_get_model_path)
    def get_model_path(model: Any, revision: str | None = None) -> Any:
        from ds4_vllm.model.embedded import embedded_model_path

        return embedded_model_path(model) or original_get_model_path(model, revision)

    @functools.wraps(original_speculators)
    def maybe_override_with_speculators(model: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        from ds4_vllm.model.gguf_serving import is_gguf_file

        if is_gguf_file(model):
            return model, tokenizer, kwargs.get("vllm_speculative_config")
        return original_speculators(model, tokenizer, *args, **kwargs)

    setattr(create_engine_config, _PATCHED_MARK, True)
    arg_utils.EngineArgs.create_engine_config = create_engine_config  # type: ignore[method-assign]  # the patch itself
    arg_utils.EngineArgs.create_model_config = create_model_config  # type: ignore[method-assign]  # the patch itself
    arg_utils.get_model_path = get_model_path
    arg_utils.maybe_override_with_speculators = maybe_override_with_speculators


def rewrite_sys_argv_for_serve() -> None:
    """Rewrite a `vllm serve` command line in `sys.argv` before vLLM parses it.

    Only the launching process rewrites: processes vLLM spawns inherit the rewritten argv and
    receive parsed configs anyway. Other programs (argv[1] is not `serve`) are left alone.
    """
    if multiprocessing.parent_process() is not None or sys.argv[1:2] != ["serve"]:
        return
    from ds4_vllm.cli.vllm_args import ArgvError, rewrite_serve_argv
    from ds4_vllm.model.default_model import default_model_dir

    try:
        sys.argv[1:] = rewrite_serve_argv(sys.argv[1:], lambda: str(default_model_dir()))
    except ArgvError as e:
        sys.stderr.write(f"vllm serve: error: {e}\n")
        raise SystemExit(2) from None


def read_deepseek_v4_tokenizer_dirs_as_ds4() -> None:
    """Let the tokenizer loader read a transformers-saved `deepseek_v4` directory (see item 3)."""
    from vllm.tokenizers import registry

    if getattr(registry.get_config, _PATCHED_MARK, False):
        return
    original_get_config = registry.get_config

    @functools.wraps(original_get_config)
    def get_config(model: Any, *args: Any, **kwargs: Any) -> Any:
        from ds4_vllm.model.config_parser import CONFIG_FORMAT, needs_ds4_config_format

        if kwargs.get("config_format", "auto") in ("auto", "hf") and needs_ds4_config_format(model):
            kwargs["config_format"] = CONFIG_FORMAT
        return original_get_config(model, *args, **kwargs)

    setattr(get_config, _PATCHED_MARK, True)
    registry.get_config = get_config


def record_request_outputs() -> None:
    """Note every RequestOutput for the HTTP request being served (see item 5)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    if getattr(AsyncLLM.generate, _PATCHED_MARK, False):
        return
    from ds4_vllm.serving.request_outputs import record_outputs

    wrapper = record_outputs(AsyncLLM.generate)
    setattr(wrapper, _PATCHED_MARK, True)
    AsyncLLM.generate = wrapper  # type: ignore[method-assign]  # the patch itself


def load_ds4_endpoint_plugin_by_default() -> None:
    """With `VLLM_PLUGINS` unset, load ds4's endpoint plugin (only it) too (see item 6)."""
    import vllm.plugins as plugins

    if getattr(plugins.load_endpoint_plugins, _PATCHED_MARK, False):
        return
    original = plugins.load_endpoint_plugins

    @functools.wraps(original)
    def load_endpoint_plugins(supported_tasks: Any = None) -> Any:
        import vllm.envs as envs

        from ds4_vllm.serving.kv_cache_route import Ds4KvCacheEndpoint

        if envs.VLLM_PLUGINS is not None:
            return original(supported_tasks)
        # vLLM would load nothing and warn that the endpoint plugins it found are not allowlisted;
        # ours is loaded here, so the warning is left to other packages' plugins.
        from importlib.metadata import entry_points

        others = [e for e in entry_points(group="vllm.endpoint_plugins") if e.name != Ds4KvCacheEndpoint.name]
        loaded = original(supported_tasks) if others else []
        plugin = Ds4KvCacheEndpoint()
        if supported_tasks is None or not set(plugin.required_tasks) & set(supported_tasks):
            return loaded
        return [*loaded, plugin]

    setattr(load_endpoint_plugins, _PATCHED_MARK, True)
    plugins.load_endpoint_plugins = load_endpoint_plugins


def keep_generators_of_discarded_rows() -> None:
    """Sample partial-prefill rows without their request's generator (see item 8)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if getattr(GPUModelRunner.sample_tokens, _PATCHED_MARK, False):
        return
    original = GPUModelRunner.sample_tokens

    @functools.wraps(original)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        hidden = _take_discarded_generators(self)
        try:
            return original(self, *args, **kwargs)
        finally:
            self.input_batch.generators.update(hidden)

    setattr(sample_tokens, _PATCHED_MARK, True)
    GPUModelRunner.sample_tokens = sample_tokens  # type: ignore[method-assign]  # the patch itself


def _take_discarded_generators(runner: Any) -> dict[int, Any]:
    """Remove and return the generators of this step's rows whose sampled token is discarded."""
    if runner.execute_model_state is None:
        return {}
    batch = runner.input_batch
    if not batch.generators:
        return {}
    import numpy as np

    discarded = np.flatnonzero(runner.discard_request_mask.np[: batch.num_reqs])
    return {int(i): batch.generators.pop(int(i)) for i in discarded if int(i) in batch.generators}


def skip_cpu_aot_compile_cache() -> None:
    """On the CPU, compile without vLLM's AOT artifact unless the user chose (see item 9)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")
