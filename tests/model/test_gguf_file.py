"""ds4 GGUF files: the engine's tiny test GGUFs open with the right config and weights, bad files
fail with errors naming the problem, and the embedded-default generator is deterministic."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as GgmlType

from ds4_vllm.model.config import Ds4Config
from ds4_vllm.model.default_model import _tokenizer_files, default_config
from ds4_vllm.model.gguf_file import Ds4GgufFile
from ds4_vllm.model.gguf_layout import GGML_TO_QUANT_TYPE
from ds4_vllm.model.gguf_metadata import Ds4GgufError
from ds4_vllm.model.gguf_tokenizer import build_tokenizer
from ds4_vllm.model.quant import QuantizedWeight
from ds4_vllm.model.tiny_gguf import tiny_gguf_file, write_tiny_gguf
from tests.shared_data import ENGINE_TESTDATA, make_engine_ggufs

REPO_ROOT = Path(__file__).resolve().parents[2]
#: shared/ sits beside the repo (CI clones it there), as for the kvc real-file tests.
MANIFEST = ENGINE_TESTDATA / "manifest.json"
QUANT_TO_GGML = {v: k for k, v in GGML_TO_QUANT_TYPE.items()}


@pytest.fixture(scope="session")
def engine_ggufs(tmp_path_factory) -> dict[str, Path]:
    """The two GGUFs the ds4 engine ran (make.sh checks their sha256 against the manifest)."""
    return make_engine_ggufs(tmp_path_factory.mktemp("ds4-engine-gguf"))


@pytest.fixture(scope="session")
def engine_files(engine_ggufs) -> dict[str, Ds4GgufFile]:
    return {q: Ds4GgufFile.open(p) for q, p in engine_ggufs.items()}


def dequantize(weight: QuantizedWeight) -> np.ndarray:
    return gguf.quants.dequantize(weight.data.numpy(), QUANT_TO_GGML[weight.qtype]).reshape(weight.shape)


# ---------------------------------------------------------------------------------------------
# The engine's files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("quant", ["q2", "q4"])
def test_engine_gguf_gives_the_tiny_models_config(engine_files, quant):
    cfg = engine_files[quant].config()
    assert isinstance(cfg, Ds4Config)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (6, 256, 129280)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rope_dim) == (4, 1, 128, 64)
    assert (cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups) == (128, 64, 2)
    assert (
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.n_shared_experts,
        cfg.moe_intermediate_size,
    ) == (
        8,
        6,
        1,
        256,
    )
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk, cfg.sliding_window) == (4, 64, 512, 128)
    assert (cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps) == (4, 20, 1e-6, 1e-6)
    assert cfg.compress_ratios == [0, 0, 4, 128, 4, 128]
    assert cfg.mlp_layer_types == ["hash_moe"] * 3 + ["moe"] * 3
    assert (cfg.swiglu_limit, cfg.routed_scaling_factor, cfg.norm_topk_prob) == (10.0, 1.5, True)
    assert cfg.max_position_embeddings == 1048576
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.num_nextn_predict_layers) == (0, 1, 0)
    assert cfg.rope_parameters["main"] == {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    }
    assert cfg.rope_parameters["compress"] == {
        "rope_type": "yarn",
        "rope_theta": 160000.0,
        "factor": 16.0,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "attention_factor": 1.0,
        "partial_rotary_factor": 0.5,
    }


def test_engine_gguf_expert_quant_bits(engine_files):
    assert engine_files["q2"].expert_quant_bits() == 2
    assert engine_files["q4"].expert_quant_bits() == 4
    assert engine_files["q4"].expert_quant_bits_by_layer() == [4] * 6


@pytest.mark.parametrize("quant", ["q2", "q4"])
def test_engine_tensors_are_native_names_over_the_memory_map(engine_files, quant):
    f = engine_files[quant]
    weights = dict(f.tensors())
    assert len(weights) == 178  # every tensor of the file, none invented (layers 3-5 carry gate.bias)
    assert not [n for n in weights if n.startswith("mtp.")]
    base, size = f._reader.data.ctypes.data, f._reader.data.size
    for name, w in weights.items():
        if name.endswith("tid2eid"):
            assert w.dtype == torch.int64 and w.shape == (129280, 6)
            assert ((w >= 0) & (w < 8)).all()
            assert all(len(set(row)) == 6 for row in w[:1000].tolist())  # 6 distinct experts per token
            continue
        tensor = w.data if isinstance(w, QuantizedWeight) else w
        assert base <= tensor.data_ptr() and tensor.data_ptr() + tensor.nbytes <= base + size, name
    assert weights["embed.weight"].dtype == torch.float16 and weights["embed.weight"].shape == (129280, 256)
    assert weights["layers.2.attn.compressor.ape"].shape == (4, 256)
    assert weights["layers.3.attn.compressor.ape"].shape == (128, 128)
    assert weights["layers.4.attn.indexer.compressor.norm.weight"].dtype == torch.float32
    head = weights["head.weight"]
    assert head.qtype.value == "Q8_0" and head.shape == (129280, 256) and head.data.shape == (129280, 272)
    w1 = weights["layers.5.ffn.experts.w1"]
    w2 = weights["layers.5.ffn.experts.w2"]
    assert w1.shape == (8, 256, 256) and w2.shape == (8, 256, 256)
    per_row = {"q2": (66, 84), "q4": (144, 144)}[quant]
    assert (w1.data.shape[-1], w2.data.shape[-1]) == per_row
    assert w1.data.dtype == torch.uint8 and w1.data.shape[:2] == (8, 256)


@pytest.mark.parametrize("quant", ["q2", "q4"])
def test_engine_quantized_weights_dequantize_like_the_reader(engine_files, engine_ggufs, quant):
    """Our QuantizedWeight bytes, dequantized, equal gguf's own reading of the same GGUF tensor."""
    f = engine_files[quant]
    plain = {t.name: t for t in gguf.GGUFReader(engine_ggufs[quant]).tensors}
    gguf_name = {s.native_name: s.gguf_name for s in f.layout}
    checked = 0
    for name, w in f.tensors():
        if not isinstance(w, QuantizedWeight):
            continue
        if name == "head.weight":
            continue  # 33M values; its rows are checked through the bigram chain below
        t = plain[gguf_name[name]]
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(w.shape)
        np.testing.assert_array_equal(dequantize(w), want)
        checked += 1
    assert checked == 6 * (5 + 3 + 3)  # per layer: 5 Q8_0 attention, 3 Q8_0 shared experts, 3 expert stacks
    # The block scales make.sh wrote (manifest "types"): gate/up vs down told apart by d.
    d = {
        "q2": {"w1": 0.01, "w3": 0.01, "w2": 1e-5},
        "q4": {"w1": 1e-4, "w3": 1e-4, "w2": 1e-8},
    }[quant]
    for proj, want_d in d.items():
        w = f.tensor(f"layers.1.ffn.experts.{proj}")
        block = gguf.GGML_QUANT_SIZES[QUANT_TO_GGML[w.qtype]][1]
        blocks = w.data.numpy().reshape(-1, block)
        at = block - 4 if w.qtype.value == "Q2_K" else 0  # Q2_K keeps d, dmin at the end
        scale = blocks[:, at : at + 2].copy().view(np.float16)
        assert (scale == np.float16(want_d)).all(), proj


def test_engine_head_and_embedding_form_the_bigram_chain(engine_files, manifest):
    """make.sh built output rows so that head · unit(embed[a]) is largest at the chain's next token b."""
    f = engine_files["q2"]
    head = dequantize(f.tensor("head.weight"))
    embed = f.tensor("embed.weight").float().numpy()
    chain = manifest["gguf"]["chain_token_ids"]
    for a, b in zip(chain[:10], chain[1:11], strict=True):
        x = embed[a] / np.sqrt(np.mean(embed[a] ** 2) + 1e-6)
        assert int(np.argmax(head @ x)) == b


def test_engine_gguf_runs_in_transformers_and_continues_the_chain(engine_files, manifest, tmp_path):
    """All native names map onto transformers' DeepseekV4 (save_pretrained naming): the dequantized
    q2 model loads with no missing weight and greedily continues `</think>` with the chain's next
    token, as the ds4 engine did."""
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    from ds4_vllm.model.config import to_transformers_config

    f = engine_files["q2"]
    state: dict[str, torch.Tensor] = {}
    for name, w in f.tensors():
        t = torch.from_numpy(dequantize(w)) if isinstance(w, QuantizedWeight) else w.clone()
        t = t if t.dtype == torch.int64 else t.float()
        if ".experts.w" in name:
            for e in range(t.shape[0]):
                state[f"model.{name[:-3]}.{e}.{name[-2:]}.weight"] = t[e].contiguous()
            continue
        if name == "embed.weight":
            name = "embed_tokens.weight"
        elif name.startswith("hc_head_"):
            name = "hc_head.hc_" + name[len("hc_head_") :]
        name = re.sub(r"^(layers\.\d+\.attn)\.kv_norm", r"\1.norm", name)
        state[name if name == "head.weight" else f"model.{name}"] = t.contiguous()
    save_file(state, str(tmp_path / "model.safetensors"))
    config = to_transformers_config(f.config())
    config.save_pretrained(tmp_path)
    model, info = DeepseekV4ForCausalLM.from_pretrained(
        tmp_path, config=config, dtype=torch.float32, output_loading_info=True
    )
    assert info["missing_keys"] == set() or info["missing_keys"] == []
    assert not info["unexpected_keys"]
    chain = manifest["gguf"]["chain_token_ids"]  # starts <think>, </think>, ...
    prompt = torch.tensor([[0, 128803, 33310, 128804, chain[1]]])  # BOS <User> "hello" <Assistant> </think>
    with torch.no_grad():
        logits = model.eval()(prompt).logits[0, -1]
    assert torch.isfinite(logits).all()
    assert int(logits.argmax()) == chain[2]


def test_engine_tokenizer_metadata_rebuilds_deepseeks_tokenizer(engine_files):
    from tokenizers import Tokenizer

    meta = engine_files["q2"].tokenizer_metadata()
    assert (len(meta.tokens), len(meta.merges), meta.model, meta.pre) == (129280, 127741, "gpt2", "joyai-llm")
    assert (meta.bos_token_id, meta.eos_token_id, meta.token_types) == (0, 1, None)
    assert meta.tokens[128821:128823] == ["<think>", "</think>"]
    ours = build_tokenizer(meta)
    reference = Tokenizer.from_str(_tokenizer_files()["tokenizer.json"].decode())
    for text in TOKENIZER_TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # Without token types only bos/eos/pad are special: decoding keeps </think>.
    assert ours.decode([128822, 33310], skip_special_tokens=True) == "</think>hello"


TOKENIZER_TEXTS = [
    "Hello world! 12345 6789",
    "你好世界，こんにちは カタカナ",
    "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Weather in Paris?<｜Assistant｜></think>OK<｜end▁of▁sentence｜>",
    "def f(x):\n    return x**2  # ~ tilde\n\n\t\tdone;\n",
    "  leading  spaces, émojis 🎉🎉 and <think>\nreason\n</think>\n\n<tool_calls>",
]


# ---------------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def small_gguf(tmp_path_factory) -> Path:
    """A valid ds4-layout file with a 512-token vocabulary (small and fast to rewrite)."""
    config = Ds4Config.from_config_dict({**default_config().to_dict(), "vocab_size": 512})
    path = tmp_path_factory.mktemp("small") / "small-q2.gguf"
    return write_tiny_gguf(path, "q2", config=config, embed_tokenizer=False)


def rewrite(
    src: Path,
    dst: Path,
    *,
    set_keys: dict | None = None,
    drop_keys: tuple[str, ...] = (),
    drop_tensors: tuple[str, ...] = (),
    replace_tensors: dict | None = None,
) -> Path:
    """Copy a GGUF with edits: keys set as (value, type[, item type]) or dropped, tensors dropped or
    replaced by (array, raw GGML type or None)."""
    set_keys, replace_tensors = set_keys or {}, replace_tensors or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, arch="unused")
    writer.kv_data[0].clear()  # the writer pre-fills general.architecture; copy the source's instead
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in drop_keys:
            continue
        if key in set_keys:
            writer.add_key_value(key, *set_keys[key])
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), field.types[0], sub)
    for t in reader.tensors:
        if t.name in drop_tensors:
            continue
        data, qtype = replace_tensors.get(t.name, (t.data, t.tensor_type))
        quantized = qtype not in (GgmlType.F16, GgmlType.F32, GgmlType.I32)
        writer.add_tensor(t.name, np.ascontiguousarray(data), raw_dtype=qtype if quantized else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def expect_error(path: Path, message: str) -> None:
    with pytest.raises(Ds4GgufError) as info:
        Ds4GgufFile.open(path)
    assert str(info.value) == f"{path}: {message}"


def test_small_generated_file_is_valid(small_gguf):
    f = Ds4GgufFile.open(small_gguf)
    assert f.config().vocab_size == 512 and f.tokenizer_metadata() is None


def test_unchanged_rewrite_is_valid(small_gguf, tmp_path):
    """The editing helper itself keeps a file valid, so each error below comes from its one edit."""
    assert Ds4GgufFile.open(rewrite(small_gguf, tmp_path / "same.gguf")).config().vocab_size == 512


def test_wrong_architecture(small_gguf, tmp_path):
    path = rewrite(
        small_gguf,
        tmp_path / "a.gguf",
        set_keys={"general.architecture": ("llama", gguf.GGUFValueType.STRING)},
    )
    expect_error(path, "general.architecture is 'llama', expected 'deepseek4' (ds4 DeepSeek V4)")


def test_missing_key(small_gguf, tmp_path):
    path = rewrite(small_gguf, tmp_path / "k.gguf", drop_keys=("deepseek4.expert_count",))
    expect_error(path, "required metadata key deepseek4.expert_count is missing")


def test_key_of_wrong_type(small_gguf, tmp_path):
    path = rewrite(
        small_gguf,
        tmp_path / "t.gguf",
        set_keys={"deepseek4.rope.freq_base": ("x", gguf.GGUFValueType.STRING)},
    )
    expect_error(path, "metadata key deepseek4.rope.freq_base has type STRING, expected a float")


U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            {"deepseek4.attention.value_length": (64, U32)},
            "deepseek4.attention.value_length = 64 differs from deepseek4.attention.key_length = 128 "
            "(K and V are the same vector)",
        ),
        (
            {"deepseek4.expert_used_count": (9, U32)},
            "deepseek4.expert_used_count = 9 exceeds deepseek4.expert_count = 8",
        ),
        (
            {"deepseek4.attention.head_count_kv": (4, U32)},
            "deepseek4.attention.head_count_kv = 4: ds4 shares one K=V head, expected 1",
        ),
        (
            {
                "deepseek4.attention.compress_ratios": (
                    [0, 0, 4, 4, 4, 128],
                    gguf.GGUFValueType.ARRAY,
                    gguf.GGUFValueType.INT32,
                )
            },
            "deepseek4.attention.compress_ratios[3] = 4, expected 128 "
            "(ds4 rule: layers 0,1 ratio 0, even >= 2 ratio 4, odd >= 3 ratio 128)",
        ),
        (
            {"deepseek4.expert_weights_norm": (False, gguf.GGUFValueType.BOOL)},
            "deepseek4.expert_weights_norm = False: ds4 renormalises routed weights, expected true",
        ),
    ],
    ids=["value_length", "expert_used_count", "head_count_kv", "compress_ratios", "expert_weights_norm"],
)
def test_inconsistent_key(small_gguf, tmp_path, edit, message):
    expect_error(rewrite(small_gguf, tmp_path / "i.gguf", set_keys=edit), message)


def test_key_that_disagrees_with_the_tensors(small_gguf, tmp_path):
    """q_lora_rank 64 while the file's tensors were built with 128: the first tensor using it is named."""
    path = rewrite(small_gguf, tmp_path / "q.gguf", set_keys={"deepseek4.attention.q_lora_rank": (64, U32)})
    expect_error(
        path,
        "tensor blk.0.attn_q_a.weight has shape [128, 256] (torch order; GGUF dims [256, 128]), "
        "expected [64, 256] from the deepseek4.* metadata",
    )


def test_missing_tensor(small_gguf, tmp_path):
    path = rewrite(small_gguf, tmp_path / "m.gguf", drop_tensors=("blk.2.indexer.proj.weight",))
    expect_error(path, "required tensors are missing: blk.2.indexer.proj.weight")


def test_wrong_tensor_shape(small_gguf, tmp_path):
    rows = gguf.quants.quantize(np.zeros((256, 128), np.float32), GgmlType.Q8_0)
    path = rewrite(
        small_gguf, tmp_path / "s.gguf", replace_tensors={"blk.1.attn_q_b.weight": (rows, GgmlType.Q8_0)}
    )
    expect_error(
        path,
        "tensor blk.1.attn_q_b.weight has shape [256, 128] (torch order; GGUF dims [128, 256]), "
        "expected [512, 128] from the deepseek4.* metadata",
    )


def test_unsupported_tensor_type(small_gguf, tmp_path):
    path = rewrite(
        small_gguf,
        tmp_path / "y.gguf",
        replace_tensors={"blk.0.attn_kv.weight": (np.zeros((128, 256), np.float16), GgmlType.F16)},
    )
    expect_error(path, "tensor blk.0.attn_kv.weight has type F16, expected Q8_0")


def test_unsupported_expert_type(small_gguf, tmp_path):
    q8 = gguf.quants.quantize(np.zeros((8, 256, 256), np.float32), GgmlType.Q8_0)
    path = rewrite(
        small_gguf, tmp_path / "e.gguf", replace_tensors={"blk.4.ffn_up_exps.weight": (q8, GgmlType.Q8_0)}
    )
    expect_error(path, "tensor blk.4.ffn_up_exps.weight has type Q8_0, expected IQ2_XXS or Q2_K or Q4_K")


def test_truncated_in_the_tensor_data(small_gguf, tmp_path):
    data = small_gguf.read_bytes()
    path = tmp_path / "short.gguf"
    path.write_bytes(data[:-1000])
    last = gguf.GGUFReader(small_gguf).tensors[-1]
    assert last.name == "blk.5.ffn_down_shexp.weight"
    end = last.data_offset + last.n_bytes
    expect_error(
        path,
        f"file is truncated: tensor blk.5.ffn_down_shexp.weight (Q8_0) occupies bytes {last.data_offset}..{end}, "
        f"but the file ends at byte {len(data) - 1000}",
    )


def test_truncated_in_the_header(small_gguf, tmp_path):
    path = tmp_path / "header.gguf"
    path.write_bytes(small_gguf.read_bytes()[:300])
    with pytest.raises(
        Ds4GgufError,
        match=r"^.*: file is truncated: its header needs .* at byte offset \d+, "
        r"but the file ends at byte 300$",
    ):
        Ds4GgufFile.open(path)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    expect_error(path, "not a readable GGUF file: GGUF magic invalid")


# ---------------------------------------------------------------------------------------------
# The embedded defaults' generator
# ---------------------------------------------------------------------------------------------


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def generated(tmp_path_factory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("generated")
    return {q: write_tiny_gguf(out / f"ds4-tiny-{q}.gguf", q) for q in ("q2", "q4")}


@pytest.fixture(scope="session")
def generated_files(generated) -> dict[str, Ds4GgufFile]:
    return {q: Ds4GgufFile.open(p) for q, p in generated.items()}


def test_generator_is_deterministic(generated, tmp_path):
    again = write_tiny_gguf(tmp_path / "again.gguf", "q2")
    assert sha256(again) == sha256(generated["q2"])


@pytest.mark.parametrize("quant", ["q2", "q4"])
def test_generated_file_validates_with_the_default_models_shape(generated_files, quant):
    f = generated_files[quant]
    assert f.expert_quant_bits() == {"q2": 2, "q4": 4}[quant]
    want, got = default_config(), f.config()
    fields = (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "moe_intermediate_size",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "sliding_window",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
        "rms_norm_eps",
        "layer_types",
        "mlp_layer_types",
        "max_position_embeddings",
        "swiglu_limit",
        "routed_scaling_factor",
        "rope_theta",
        "compress_rope_theta",
        "bos_token_id",
        "eos_token_id",
    )
    for field in fields:
        assert getattr(got, field) == getattr(want, field), field
    assert got.rope_parameters["compress"] == want.rope_parameters["compress"]
    assert got.rope_parameters["main"] == want.rope_parameters["main"]


@pytest.mark.parametrize(("quant", "types"), [("q2", ("IQ2_XXS", "Q2_K")), ("q4", ("Q4_K", "Q4_K"))])
def test_generated_weights_have_the_real_files_types_and_sane_magnitudes(generated_files, quant, types):
    w = dict(generated_files[quant].tensors())
    assert (w["layers.3.ffn.experts.w1"].qtype.value, w["layers.3.ffn.experts.w2"].qtype.value) == types
    assert w["layers.3.attn.wq_b.weight"].qtype.value == "Q8_0"
    assert w["layers.3.ffn.shared_experts.w2.weight"].qtype.value == "Q8_0"
    assert w["head.weight"].qtype.value == "Q8_0"
    assert w["layers.2.attn.indexer.weights_proj.weight"].dtype == torch.float16
    assert w["layers.3.hc_ffn_fn"].dtype == torch.float16 and w["norm.weight"].dtype == torch.float32
    # Random expert blocks: zero mean, std 1/sqrt(256) = 0.0625. Measured over the 18 stacks of both
    # recipes: std 0.0619..0.0628 and |mean| <= 0.0003, so 3 % and 0.002 leave room without hiding a
    # wrong d/dmin (a wrong dmin shifts the mean by >= 0.03, a wrong d scales the std by >= 1.5).
    for il in range(6):
        for proj in ("w1", "w2", "w3"):
            values = dequantize(w[f"layers.{il}.ffn.experts.{proj}"])
            assert abs(values.std() / 0.0625 - 1) < 0.03, (il, proj, values.std())
            assert abs(values.mean()) < 0.002, (il, proj, values.mean())


def test_generated_file_embeds_the_default_models_tokenizer(generated_files):
    from tokenizers import Tokenizer

    meta = generated_files["q4"].tokenizer_metadata()
    assert meta.token_types is not None and meta.chat_template
    reference_json = json.loads(_tokenizer_files()["tokenizer.json"])
    special = {a["id"]: a["special"] for a in reference_json["added_tokens"]}
    ours = build_tokenizer(meta)
    assert {i: t.special for i, t in ours.get_added_tokens_decoder().items()} == special
    reference = Tokenizer.from_str(json.dumps(reference_json))
    for text in TOKENIZER_TEXTS:
        assert ours.encode(text).ids == reference.encode(text).ids, text


def test_tiny_gguf_file_materializes_once_in_the_cache(generated, tmp_path, monkeypatch):
    monkeypatch.setenv("DS4_VLLM_CACHE", str(tmp_path))
    path = tiny_gguf_file("ds4-tiny-q2")
    assert path.parent == tmp_path / "models" and path.name.startswith("ds4-tiny-q2-")
    assert sha256(path) == sha256(generated["q2"])
    mtime = path.stat().st_mtime_ns
    assert tiny_gguf_file("ds4-tiny-q2") == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in (tmp_path / "models").iterdir()] == [path.name]  # no temp file left
    with pytest.raises(ValueError, match="unknown embedded GGUF 'ds4-tiny-q3'"):
        tiny_gguf_file("ds4-tiny-q3")


def test_missing_router_bias_reads_as_zeros(small_gguf, tmp_path):
    """ds4 treats an absent exp_probs_b as no bias; the loader still gets every native name."""
    f = Ds4GgufFile.open(rewrite(small_gguf, tmp_path / "b.gguf", drop_tensors=("blk.4.exp_probs_b.bias",)))
    assert torch.equal(f.tensor("layers.4.ffn.gate.bias"), torch.zeros(8))
    assert not torch.equal(f.tensor("layers.5.ffn.gate.bias"), torch.zeros(8))


def test_mixed_expert_layers_report_bits_per_layer(small_gguf, tmp_path):
    """ds4's splicer upgrades some layers' experts to Q4_K; one bit count cannot describe that."""
    q4 = {
        f"blk.5.ffn_{w}_exps.weight": (np.zeros((8, 256, 256 // 256 * 144), np.uint8), GgmlType.Q4_K)
        for w in ("gate", "up", "down")
    }
    f = Ds4GgufFile.open(rewrite(small_gguf, tmp_path / "mixed.gguf", replace_tensors=q4))
    assert f.expert_quant_bits_by_layer() == [2, 2, 2, 2, 2, 4]
    with pytest.raises(Ds4GgufError, match=r"routed experts mix 2-bit and 4-bit layers \(4-bit: \[5\]\)"):
        f.expert_quant_bits()
