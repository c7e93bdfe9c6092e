"""Checkpoint tensor names → `Ds4ForCausalLM` parameter names, for every DeepSeek V4 layout.

Three naming schemes reach the loader (`../shared/specs/checkpoint-formats.md` §1):

- native names of the official release (`layers.N.attn.wq_a.weight`, `head.weight`, ...), also
  what the ds4 GGUF reader hands out;
- transformers' `save_pretrained` output: the native names with a `model.` prefix and three
  renames (`model.embed_tokens`, `model.hc_head.hc_X`, the main attention's `attn.norm`);
- transformers' in-memory names, which are this model's own parameter names except for the
  indexer's compressor (nested the other way round) and the fused `experts.gate_up_proj`; a
  directory transformers loaded from such names and saved again has them with `norm` for
  `kv_norm`.

`model_name` renames the first two onto the third; its regexes apply in order, as vLLM's
`WeightsMapper` applies them, so the saved layout is first normalised to native names, then native
names are mapped onto ours. Names already in our form pass through untouched. It is written out
here rather than through `WeightsMapper` so that the model loads without vLLM (issue 25: the GPU
check runs where vLLM cannot be installed).

Routed experts come per expert in the native layouts (`layers.N.ffn.experts.E.w1.weight`); they
map to `...mlp.experts.E.gate_proj.weight`, which `expert_slot` splits into the stacked
weight's name and the expert index; a whole stack (`layers.N.ffn.experts.w1`, from a GGUF) maps
to the stack module `...mlp.experts.gate_proj`.
"""

from __future__ import annotations

import re

_L = r"layers\.(\d+)"
_OURS = r"model.layers.\1"


# Step 1: transformers' saved layout → native names.
_SAVED_TO_NATIVE = [
    (r"^model\.embed_tokens\.", "embed."),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.norm\.", "norm."),
    (r"^model\.(layers\.\d+\.(?:attn\.|ffn\.|attn_norm\.|ffn_norm\.|hc_attn_|hc_ffn_))", r"\1"),
    (rf"^({_L}\.attn)\.norm\.", r"\1.kv_norm."),
]

_MAIN_ATTENTION = {
    "wq_a": "q_a_proj",
    "q_norm": "q_a_norm",
    "wq_b": "q_b_proj",
    "wkv": "kv_proj",
    "kv_norm": "kv_norm",
    "wo_a": "o_a_proj",
    "wo_b": "o_b_proj",
}
_COMPRESSOR = {"wkv": "kv_proj", "wgate": "gate_proj", "norm": "kv_norm"}
_EXPERT = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

# Step 2: native names → this model's parameters.
_NATIVE_TO_MODEL = [
    (r"^embed\.", "model.embed_tokens."),
    (r"^head\.", "lm_head."),
    (r"^norm\.", "model.norm."),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (rf"^{_L}\.attn_norm\.", rf"{_OURS}.input_layernorm."),
    (rf"^{_L}\.ffn_norm\.", rf"{_OURS}.post_attention_layernorm."),
    (rf"^{_L}\.hc_(attn|ffn)_(fn|base|scale)$", rf"{_OURS}.\2_hc.\3"),
    (rf"^{_L}\.attn\.attn_sink$", rf"{_OURS}.self_attn.sinks"),
    *((rf"^{_L}\.attn\.{n}\.", rf"{_OURS}.self_attn.{m}.") for n, m in _MAIN_ATTENTION.items()),
    (rf"^{_L}\.attn\.indexer\.wq_b\.", rf"{_OURS}.self_attn.compressor.indexer.q_b_proj."),
    (rf"^{_L}\.attn\.indexer\.weights_proj\.", rf"{_OURS}.self_attn.compressor.indexer.scorer.weights_proj."),
    (rf"^{_L}\.attn\.indexer\.compressor\.", rf"{_OURS}.self_attn.compressor.indexer.compressor."),
    (rf"^{_L}\.attn\.compressor\.", rf"{_OURS}.self_attn.compressor."),
    *((rf"\.compressor\.{n}\.", f".compressor.{m}.") for n, m in _COMPRESSOR.items()),
    (r"\.compressor\.ape$", ".compressor.position_bias"),
    (rf"^{_L}\.ffn\.gate\.bias$", rf"{_OURS}.mlp.gate.e_score_correction_bias"),
    (rf"^{_L}\.ffn\.gate\.", rf"{_OURS}.mlp.gate."),
    *(
        (rf"^{_L}\.ffn\.shared_experts\.{n}\.", rf"{_OURS}.mlp.shared_experts.{m}.")
        for n, m in _EXPERT.items()
    ),
    *((rf"^{_L}\.ffn\.experts\.(\d+)\.{n}\.", rf"{_OURS}.mlp.experts.\2.{m}.") for n, m in _EXPERT.items()),
    # A whole stack at once ([E, out, in]), as the ds4 GGUF reader hands it out.
    *((rf"^{_L}\.ffn\.experts\.{n}$", rf"{_OURS}.mlp.experts.{m}") for n, m in _EXPERT.items()),
]

# transformers' in-memory names that differ from ours. A directory that transformers loaded from
# in-memory names and saved again keeps them, except that every `kv_norm` is written as `norm`.
_IN_MEMORY_TO_MODEL = [
    (r"\.(self_attn|indexer)\.norm\.", r".\1.kv_norm."),
    (
        r"\.compressor\.indexer\.(kv_proj|gate_proj|position_bias|kv_norm)\b",
        r".compressor.indexer.compressor.\1",
    ),
]

_RENAMES = [
    (re.compile(pattern), target)
    for pattern, target in _SAVED_TO_NATIVE + _NATIVE_TO_MODEL + _IN_MEMORY_TO_MODEL
]


def model_name(name: str) -> str:
    """This model's parameter name for checkpoint tensor ``name`` (every rule in order)."""
    for pattern, target in _RENAMES:
        if pattern.search(name):
            name = pattern.sub(target, name)
    return name


#: Multi-token-prediction tensors (`mtp.J.*`): the model has no MTP head, so they are skipped.
MTP_PATTERN = re.compile(r"^(model\.)?mtp\.")

_EXPERT_SLOT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|scale)$")
#: transformers' fused in-memory experts: gate rows first, then up rows.
FUSED_GATE_UP = re.compile(r"^(.*\.mlp\.experts)\.gate_up_proj$")


def expert_slot(name: str) -> tuple[str, int, str] | None:
    """`...mlp.experts.E.gate_proj.weight` → (`...mlp.experts.gate_proj`, E, `weight`); else None."""
    match = _EXPERT_SLOT.match(name)
    if match is None:
        return None
    return f"{match[1]}.{match[3]}", int(match[2]), match[4]
