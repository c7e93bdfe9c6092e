"""The ds4 engine's DeepSeek V4 Flash GGUF layout: the `deepseek4.*` dimensions and every tensor
they imply, with the types ds4 accepts (`weights_bind` / `weights_validate_layout` in `ds4.c`).

Shared by the reader (`gguf_file`) and the writers of GGUF files (`tiny_gguf`, the benchmark slice).
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as GgmlType

from ds4_vllm.model.config import Ds4Config, ds4_compress_ratio
from ds4_vllm.model.quant import QuantType

GGUF_ARCHITECTURE = "deepseek4"
KEY_PREFIX = "deepseek4."


# ---------------------------------------------------------------------------------------------
# Dimensions and the tensor layout they imply
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ds4GgufDims:
    """The widths a ds4-layout file is built from (one `deepseek4.*` key each)."""

    n_layer: int
    n_embd: int
    n_vocab: int
    n_head: int
    head_dim: int
    n_rot: int
    q_lora_rank: int
    o_lora_rank: int
    n_out_group: int
    n_expert: int
    n_expert_used: int
    n_ff_exp: int
    n_hash_layer: int
    indexer_heads: int
    indexer_head_dim: int
    n_hc: int

    @property
    def compress_ratios(self) -> list[int]:
        return [ds4_compress_ratio(i) for i in range(self.n_layer)]

    @classmethod
    def from_config(cls, config: Ds4Config) -> Ds4GgufDims:
        return cls(
            n_layer=config.num_hidden_layers,
            n_embd=config.hidden_size,
            n_vocab=config.vocab_size,
            n_head=config.num_attention_heads,
            head_dim=config.head_dim,
            n_rot=config.rope_dim,
            q_lora_rank=config.q_lora_rank,
            o_lora_rank=config.o_lora_rank,
            n_out_group=config.o_groups,
            n_expert=config.n_routed_experts,
            n_expert_used=config.num_experts_per_tok,
            n_ff_exp=config.moe_intermediate_size,
            n_hash_layer=list(config.mlp_layer_types).count("hash_moe"),
            indexer_heads=config.index_n_heads,
            indexer_head_dim=config.index_head_dim,
            n_hc=config.hc_mult,
        )


# Routed-expert block formats ds4 runs, and the recipe each one belongs to.
EXPERT_TYPE_BITS: dict[GgmlType, int] = {GgmlType.IQ2_XXS: 2, GgmlType.Q2_K: 2, GgmlType.Q4_K: 4}
EXPERT_TYPES = tuple(EXPERT_TYPE_BITS)

GGML_TO_QUANT_TYPE: dict[GgmlType, QuantType] = {
    GgmlType.Q8_0: QuantType.Q8_0,
    GgmlType.Q2_K: QuantType.Q2_K,
    GgmlType.Q4_K: QuantType.Q4_K,
    GgmlType.IQ2_XXS: QuantType.IQ2_XXS,
}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the ds4 layout: its GGUF name, native DeepSeek name, torch shape, and types."""

    gguf_name: str
    native_name: str
    shape: tuple[int, ...]  # torch order ([..., out, in]); GGUF lists the dims reversed
    types: tuple[GgmlType, ...]  # the types ds4 accepts; the first is what the real files use
    optional: bool = False


def ds4_tensor_layout(dims: Ds4GgufDims) -> list[TensorSpec]:
    """Every tensor ds4 binds, in file order (`weights_bind`/`weights_validate_layout` in ds4.c).

    Types are ds4's: Q8_0 for attention, shared experts and the LM head; F16 for the embedding,
    HC mixers, router, compressors and indexer; F32 for norms, HC base/scale, sinks and the router
    bias; I32 for the hash-routing table; IQ2_XXS/Q2_K/Q4_K for routed experts.
    """
    d = dims
    hc_dim = d.n_hc * d.n_embd
    hc_mix = 2 * d.n_hc + d.n_hc * d.n_hc
    f16, f32, q8, i32 = (GgmlType.F16,), (GgmlType.F32,), (GgmlType.Q8_0,), (GgmlType.I32,)
    specs = [
        TensorSpec("token_embd.weight", "embed.weight", (d.n_vocab, d.n_embd), f16),
        TensorSpec("output.weight", "head.weight", (d.n_vocab, d.n_embd), q8),
        TensorSpec("output_norm.weight", "norm.weight", (d.n_embd,), f32),
        TensorSpec("output_hc_fn.weight", "hc_head_fn", (d.n_hc, hc_dim), f16),
        TensorSpec("output_hc_base.weight", "hc_head_base", (d.n_hc,), f32),
        TensorSpec("output_hc_scale.weight", "hc_head_scale", (1,), f32),
    ]
    group_in = d.head_dim * (d.n_head // max(d.n_out_group, 1))
    for il, ratio in enumerate(d.compress_ratios):
        b, n, a = f"blk.{il}.", f"layers.{il}.", f"layers.{il}.attn."
        for part in ("attn", "ffn"):
            specs += [
                TensorSpec(f"{b}hc_{part}_fn.weight", f"{n}hc_{part}_fn", (hc_mix, hc_dim), f16),
                TensorSpec(f"{b}hc_{part}_scale.weight", f"{n}hc_{part}_scale", (3,), f32),
                TensorSpec(f"{b}hc_{part}_base.weight", f"{n}hc_{part}_base", (hc_mix,), f32),
            ]
        specs += [
            TensorSpec(f"{b}attn_norm.weight", f"{n}attn_norm.weight", (d.n_embd,), f32),
            TensorSpec(f"{b}attn_q_a.weight", f"{a}wq_a.weight", (d.q_lora_rank, d.n_embd), q8),
            TensorSpec(f"{b}attn_q_a_norm.weight", f"{a}q_norm.weight", (d.q_lora_rank,), f32),
            TensorSpec(f"{b}attn_q_b.weight", f"{a}wq_b.weight", (d.n_head * d.head_dim, d.q_lora_rank), q8),
            TensorSpec(f"{b}attn_kv.weight", f"{a}wkv.weight", (d.head_dim, d.n_embd), q8),
            TensorSpec(f"{b}attn_kv_a_norm.weight", f"{a}kv_norm.weight", (d.head_dim,), f32),
            TensorSpec(f"{b}attn_sinks.weight", f"{a}attn_sink", (d.n_head,), f32),
            TensorSpec(
                f"{b}attn_output_a.weight", f"{a}wo_a.weight", (d.n_out_group * d.o_lora_rank, group_in), q8
            ),
            TensorSpec(
                f"{b}attn_output_b.weight", f"{a}wo_b.weight", (d.n_embd, d.n_out_group * d.o_lora_rank), q8
            ),
        ]
        if ratio:
            width = (2 if ratio == 4 else 1) * d.head_dim  # ratio 4 pools overlapping windows
            c = f"{a}compressor."
            specs += [
                TensorSpec(f"{b}attn_compressor_ape.weight", f"{c}ape", (ratio, width), f16),
                TensorSpec(f"{b}attn_compressor_kv.weight", f"{c}wkv.weight", (width, d.n_embd), f16),
                TensorSpec(f"{b}attn_compressor_gate.weight", f"{c}wgate.weight", (width, d.n_embd), f16),
                TensorSpec(f"{b}attn_compressor_norm.weight", f"{c}norm.weight", (d.head_dim,), f32),
            ]
        if ratio == 4:
            x, ic = f"{a}indexer.", f"{a}indexer.compressor."
            iw = 2 * d.indexer_head_dim
            specs += [
                TensorSpec(
                    f"{b}indexer.attn_q_b.weight",
                    f"{x}wq_b.weight",
                    (d.indexer_heads * d.indexer_head_dim, d.q_lora_rank),
                    f16,
                ),
                TensorSpec(
                    f"{b}indexer.proj.weight", f"{x}weights_proj.weight", (d.indexer_heads, d.n_embd), f16
                ),
                TensorSpec(f"{b}indexer_compressor_ape.weight", f"{ic}ape", (ratio, iw), f16),
                TensorSpec(f"{b}indexer_compressor_kv.weight", f"{ic}wkv.weight", (iw, d.n_embd), f16),
                TensorSpec(f"{b}indexer_compressor_gate.weight", f"{ic}wgate.weight", (iw, d.n_embd), f16),
                TensorSpec(
                    f"{b}indexer_compressor_norm.weight", f"{ic}norm.weight", (d.indexer_head_dim,), f32
                ),
            ]
        f = f"{n}ffn."
        hash_layer = il < d.n_hash_layer
        specs += [
            TensorSpec(f"{b}ffn_norm.weight", f"{n}ffn_norm.weight", (d.n_embd,), f32),
            TensorSpec(f"{b}ffn_gate_inp.weight", f"{f}gate.weight", (d.n_expert, d.n_embd), f16),
        ]
        if not hash_layer:
            # ds4 treats a missing bias as zeros (`tensor_by_namef`); `tensors()` yields zeros then.
            specs.append(
                TensorSpec(f"{b}exp_probs_b.bias", f"{f}gate.bias", (d.n_expert,), f32, optional=True)
            )
        specs += [
            TensorSpec(
                f"{b}ffn_gate_exps.weight", f"{f}experts.w1", (d.n_expert, d.n_ff_exp, d.n_embd), EXPERT_TYPES
            ),
            TensorSpec(
                f"{b}ffn_up_exps.weight", f"{f}experts.w3", (d.n_expert, d.n_ff_exp, d.n_embd), EXPERT_TYPES
            ),
            TensorSpec(
                f"{b}ffn_down_exps.weight", f"{f}experts.w2", (d.n_expert, d.n_embd, d.n_ff_exp), EXPERT_TYPES
            ),
            TensorSpec(
                f"{b}ffn_gate_shexp.weight", f"{f}shared_experts.w1.weight", (d.n_ff_exp, d.n_embd), q8
            ),
            TensorSpec(f"{b}ffn_up_shexp.weight", f"{f}shared_experts.w3.weight", (d.n_ff_exp, d.n_embd), q8),
            TensorSpec(
                f"{b}ffn_down_shexp.weight", f"{f}shared_experts.w2.weight", (d.n_embd, d.n_ff_exp), q8
            ),
        ]
        if hash_layer:
            specs.append(
                TensorSpec(
                    f"{b}ffn_gate_tid2eid.weight", f"{f}gate.tid2eid", (d.n_vocab, d.n_expert_used), i32
                )
            )
    return specs


#: `Ds4GgufDims` field -> its metadata key after `KEY_PREFIX`.
DIM_KEYS = {
    "n_layer": "block_count",
    "n_embd": "embedding_length",
    "n_vocab": "vocab_size",
    "n_head": "attention.head_count",
    "head_dim": "attention.key_length",
    "n_rot": "rope.dimension_count",
    "q_lora_rank": "attention.q_lora_rank",
    "o_lora_rank": "attention.output_lora_rank",
    "n_out_group": "attention.output_group_count",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "n_ff_exp": "expert_feed_forward_length",
    "n_hash_layer": "hash_layer_count",
    "indexer_heads": "attention.indexer.head_count",
    "indexer_head_dim": "attention.indexer.key_length",
    "n_hc": "hyper_connection.count",
}
