"""`Ds4Config`: transformers' DeepseekV4Config under our own `model_type`.

Why a subclass with `model_type = "ds4"`: vLLM special-cases `model_type == "deepseek_v4"`
(CPU platform forces block size 256, turns on MLA and, without AMX, turns chunked prefill and
prefix caching off; it also picks its own config class and tokenizer mode). A distinct model type
keeps all of that away from our pure-PyTorch model while every field keeps its upstream meaning.

The class also checks that a config describes a model ds4's graph can run (`check_ds4_layout`);
it raises `ValueError` naming the offending field.

`ds4_official_numerics` (see `Ds4Config.official_numerics`) switches on the quantization round
trips of DeepSeek's official graph (`ds4_vllm.model.qat`).
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV4Config

DS4_MODEL_TYPE = "ds4"
DS4_ARCHITECTURE = "Ds4ForCausalLM"

# ds4's layer types by compression ratio (`ds4_layer_compress_ratio`).
RATIO_TO_LAYER_TYPE: dict[int, str] = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}
DS4_COMPRESS_RATES: dict[str, int] = {
    "compressed_sparse_attention": 4,
    "heavily_compressed_attention": 128,
}


#: Config key of the official-numerics switch (`Ds4Config.official_numerics`).
OFFICIAL_NUMERICS_KEY = "ds4_official_numerics"
#: config.json keys that only DeepSeek's quantized (QAT-trained FP8/FP4) releases carry
#: (`from_config_dict` keeps `quantization_config` as `checkpoint_quantization`).
QUANTIZED_RELEASE_KEYS = ("quantization_config", "checkpoint_quantization", "expert_dtype")


def official_numerics_default(config: Any) -> bool:
    """The switch's value when a config does not set it: on for DeepSeek's quantized releases.

    A config read from the official release's config.json carries `quantization_config` (FP8
    weights) and `expert_dtype` (FP4 experts): on. The embedded default model, configs written
    by `Ds4Config`/transformers from float weights, and hand-built configs carry neither: off,
    so logits stay comparable with transformers' DeepseekV4ForCausalLM, which has none of these
    round trips. A loader that builds the config from a ds4 GGUF (a conversion of the official
    release, which ds4 always runs with these numerics) sets the key to True itself.
    """
    return any(getattr(config, key, None) is not None for key in QUANTIZED_RELEASE_KEYS)


def routed_expert_quant_bits(config: Any) -> int:
    """The routed experts' quant bits that KVC headers record: 2 or 4 from a ds4 GGUF, else 4.

    Float and official (FP4 experts) checkpoints record 4, the ds4 engine's q4 recipe.
    """
    return int(getattr(config, "routed_expert_quant_bits", None) or 4)


def ds4_compress_ratio(layer: int) -> int:
    """ds4's fixed schedule: layers 0,1 → 0 (window only); even ≥ 2 → 4; odd ≥ 3 → 128."""
    if layer < 2:
        return 0
    return 4 if layer % 2 == 0 else 128


def ds4_layer_types(num_layers: int) -> list[str]:
    return [RATIO_TO_LAYER_TYPE[ds4_compress_ratio(i)] for i in range(num_layers)]


class Ds4Config(DeepseekV4Config):
    """DeepSeek V4 (Flash) config as ds4 runs it; see the module docstring."""

    model_type = DS4_MODEL_TYPE

    def __post_init__(self, **kwargs: Any) -> None:
        # Upstream's default schedule is V4-Pro's (ratio 128 first). Use ds4's (Flash) rule when
        # neither `layer_types` nor the legacy `compress_ratios` is given.
        if self.layer_types is None and kwargs.get("compress_ratios") is None:
            self.layer_types = ds4_layer_types(self.num_hidden_layers)
        super().__post_init__(**kwargs)
        # vLLM reads rope parameters keyed by layer type, or else one flat dict with a top-level
        # "rope_type"; V4 keys them by rope label ("main"/"compress"). A top-level "default"
        # makes vLLM's context-length check treat them as unscaled; transformers only reads
        # the nested dicts.
        if isinstance(self.rope_parameters, dict):
            self.rope_parameters.setdefault("rope_type", "default")
        # Decided once, from the file as read: later edits of `quantization_config` (a loader
        # taking over quantization) must not flip the numerics. Unset stays unset (off), so the
        # default model's config.json is unchanged.
        if getattr(self, OFFICIAL_NUMERICS_KEY, None) is None and official_numerics_default(self):
            setattr(self, OFFICIAL_NUMERICS_KEY, True)
        self.check_ds4_layout()

    @property
    def official_numerics(self) -> bool:
        """Whether the model applies the official graph's QAT round trips (`ds4_vllm.model.qat`).

        The FP8 round trip of main KV rows and the Hadamard + FP4 round trip of indexer queries
        and keys (spec ds4-model-and-vllm.md §1.11). Set by config.json key
        `ds4_official_numerics` (true/false), or per run with
        `--hf-overrides '{"ds4_official_numerics": false}'`; unset, `official_numerics_default`
        decides when the config is read (on for the official release and GGUF files, off for
        the embedded default model and transformers-saved float checkpoints).

        Checked on every read, so a value set after construction (`--hf-overrides`) is checked
        too (`check_official_numerics`).
        """
        self.check_official_numerics()
        return bool(getattr(self, OFFICIAL_NUMERICS_KEY, None))

    def check_official_numerics(self) -> None:
        """Raise ValueError for a non-bool switch, or, when on, widths the round trips cannot block."""
        value = getattr(self, OFFICIAL_NUMERICS_KEY, None)
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"Ds4Config.{OFFICIAL_NUMERICS_KEY}: must be true or false, got {value!r}")
        if value:
            self._check_official_numerics_widths()

    @property
    def rope_dim(self) -> int:
        """Rotary dims per head: the last `rope_dim` of each head (and of each indexer head)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def compress_ratios(self) -> list[int]:
        """Per-layer compression ratio (0, 4 or 128), derived from `layer_types`."""
        rates = {"sliding_attention": 0, **self.compress_rates}
        return [int(rates[t]) for t in self.layer_types]

    def check_ds4_layout(self) -> None:
        """Raise ValueError (naming the field) when ds4's graph cannot run this config."""

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"Ds4Config.{field}: {why}")

        n = self.num_hidden_layers
        need(n >= 1, "num_hidden_layers", f"must be ≥ 1, got {n}")
        need(
            dict(self.compress_rates) == DS4_COMPRESS_RATES,
            "compress_rates",
            f"must be {DS4_COMPRESS_RATES}, got {self.compress_rates}",
        )
        want = ds4_layer_types(n)
        need(len(self.layer_types) == n, "layer_types", f"needs {n} entries, got {len(self.layer_types)}")
        for i, (got, exp) in enumerate(zip(self.layer_types, want, strict=True)):
            need(
                got == exp,
                "layer_types",
                f"layer {i} must be {exp!r} (ds4 rule: layers 0,1 ratio 0, even ≥2 ratio 4, "
                f"odd ≥3 ratio 128), got {got!r}",
            )
        mlp = list(self.mlp_layer_types)
        n_hash = mlp.count("hash_moe")
        need(
            mlp == ["hash_moe"] * n_hash + ["moe"] * (n - n_hash),
            "mlp_layer_types",
            f"hash_moe layers must come first, then moe; got {mlp}",
        )
        need(
            self.num_key_value_heads == 1, "num_key_value_heads", f"must be 1, got {self.num_key_value_heads}"
        )
        need(self.hc_mult >= 1, "hc_mult", f"must be ≥ 1, got {self.hc_mult}")
        need(self.hc_sinkhorn_iters >= 1, "hc_sinkhorn_iters", f"must be ≥ 1, got {self.hc_sinkhorn_iters}")
        need(self.o_groups >= 1, "o_groups", f"must be ≥ 1, got {self.o_groups}")
        need(
            self.num_attention_heads % self.o_groups == 0,
            "num_attention_heads",
            f"{self.num_attention_heads} is not divisible by o_groups={self.o_groups}",
        )
        rope = self.rope_dim
        need(
            rope > 0 and rope % 2 == 0,
            "partial_rotary_factor",
            f"rope dim head_dim·partial_rotary_factor = {rope} must be even and > 0",
        )
        need(
            rope <= self.head_dim,
            "partial_rotary_factor",
            f"rope dim {rope} exceeds head_dim={self.head_dim}",
        )
        need(
            rope <= self.index_head_dim,
            "index_head_dim",
            f"{self.index_head_dim} is smaller than the rope dim {rope}",
        )
        need(
            self.scoring_func == "sqrtsoftplus",
            "scoring_func",
            f"must be 'sqrtsoftplus', got {self.scoring_func!r}",
        )
        need(self.hidden_act == "silu", "hidden_act", f"must be 'silu', got {self.hidden_act!r}")
        need(self.n_shared_experts == 1, "n_shared_experts", f"must be 1, got {self.n_shared_experts}")
        need(
            1 <= self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            f"must be in 1..n_routed_experts={self.n_routed_experts}, got {self.num_experts_per_tok}",
        )
        self.check_official_numerics()
        for field in (
            "q_lora_rank",
            "o_lora_rank",
            "sliding_window",
            "index_n_heads",
            "index_topk",
            "moe_intermediate_size",
        ):
            need(getattr(self, field) > 0, field, f"must be > 0, got {getattr(self, field)}")

    def _check_official_numerics_widths(self) -> None:
        from ds4_vllm.model.qat import FP4_BLOCK, FP8_KV_BLOCK, HADAMARD_BLOCK

        def need(ok: bool, field: str, why: str) -> None:
            if not ok:
                raise ValueError(f"Ds4Config.{field}: {why}")

        nope = self.head_dim - self.rope_dim
        need(
            nope % FP8_KV_BLOCK == 0,
            "head_dim",
            f"{OFFICIAL_NUMERICS_KEY}: the {nope} no-RoPE dims are not a multiple of the FP8 block "
            f"{FP8_KV_BLOCK}",
        )
        width = self.index_head_dim
        hadamard_ok = width % HADAMARD_BLOCK == 0 or (width & (width - 1) == 0)
        need(
            hadamard_ok and width % FP4_BLOCK == 0,
            "index_head_dim",
            f"{OFFICIAL_NUMERICS_KEY}: {width} must be a multiple of {HADAMARD_BLOCK} or a power of two, "
            f"and a multiple of the FP4 block {FP4_BLOCK}",
        )

    @classmethod
    def from_config_dict(cls, config_dict: dict[str, Any]) -> Ds4Config:
        """Build from a config.json dict of any DeepSeek V4 flavour (e.g. `model_type: deepseek_v4`).

        Keys that belong to the other class (its model type, the writer's version, vision-tower
        extras of vLLM's V4 config) are dropped; legacy V4 keys (`compress_ratios`,
        `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) are understood as upstream does.
        """
        data = {
            k: v
            for k, v in config_dict.items()
            if k not in ("model_type", "transformers_version") and not k.startswith(("vision_", "mm_"))
        }
        if "rope_scaling" in data and not data.get("rope_parameters"):
            data["rope_parameters"] = data.pop("rope_scaling")
        # The official release's FP8/FP4 description. Kept under our own key: under its own name
        # vLLM would apply its FP8 method to a model that dequantizes its own weights.
        if "quantization_config" in data:
            data["checkpoint_quantization"] = data.pop("quantization_config")
        return cls(**data)


def register_auto_config() -> None:
    """Let transformers' Auto classes (AutoConfig, AutoTokenizer) read `model_type: ds4` dirs."""
    from transformers import AutoConfig

    AutoConfig.register(DS4_MODEL_TYPE, Ds4Config, exist_ok=True)


def to_transformers_config(config: Ds4Config) -> DeepseekV4Config:
    """The same model as transformers' DeepseekV4Config (for the reference implementation)."""
    data = config.to_dict()
    for key in ("model_type", "transformers_version", "qk_rope_head_dim"):
        data.pop(key, None)
    data["architectures"] = ["DeepseekV4ForCausalLM"]
    return DeepseekV4Config(**data)


#: DeepSeek V4 Flash's rotary dims per head (the last 64 of each head); narrower heads keep 64.
FLASH_ROPE_DIMS = 64
#: Flash routes its first three layers by token hash.
FLASH_HASH_LAYERS = 3


def flash_config(**overrides: Any) -> Ds4Config:
    """DeepSeek V4 Flash's config: its real widths and structural constants (43 layers).

    `overrides` are Ds4Config fields (narrower widths for the tiny models and benchmark slices).
    Unless given, the layer kinds follow the layer count (hash routing on the first three) and
    the rotary fraction keeps 64 rotary dims whatever `head_dim` is.
    """
    fields: dict[str, Any] = dict(
        architectures=[DS4_ARCHITECTURE],
        dtype="float32",
        vocab_size=129280,
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        num_key_value_heads=1,
        head_dim=512,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        num_experts_per_tok=6,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        routed_scaling_factor=1.5,
        swiglu_limit=10.0,
        sliding_window=128,
        index_n_heads=64,
        index_head_dim=128,
        index_topk=512,
        hc_mult=4,
        hc_sinkhorn_iters=20,
        hc_eps=1e-6,
        rms_norm_eps=1e-6,
        max_position_embeddings=1048576,
        num_nextn_predict_layers=0,
        rope_theta=10000.0,
        compress_rope_theta=160000.0,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    if "mlp_layer_types" not in overrides:
        n_hash = min(FLASH_HASH_LAYERS, fields["num_hidden_layers"])
        fields["mlp_layer_types"] = ["hash_moe"] * n_hash + ["moe"] * (fields["num_hidden_layers"] - n_hash)
    fraction = overrides.get("partial_rotary_factor", FLASH_ROPE_DIMS / fields["head_dim"])
    fields["partial_rotary_factor"] = fraction
    if "rope_parameters" not in overrides:
        fields["rope_parameters"] = {
            "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": fraction},
            "compress": {
                "rope_type": "yarn",
                "rope_theta": 160000.0,
                "factor": 16.0,
                "original_max_position_embeddings": 65536,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "attention_factor": 1.0,
                "partial_rotary_factor": fraction,
            },
        }
    return Ds4Config(**fields)
