"""A Hugging Face tokenizer built from the vocabulary a ds4 GGUF embeds.

ds4 GGUFs carry DeepSeek V4's byte-level BPE as `tokenizer.ggml.*` metadata (tokens, merges,
`pre = "joyai-llm"`), not as a `tokenizer.json`. `hf_tokenizer_json` rebuilds the `tokenizer.json`
DeepSeek ships, with the `tokenizers` library: BPE model from the tokens and merges, the three
regex splits llama.cpp runs for `joyai-llm` followed by byte-level encoding, and the added tokens.

Added tokens: with `tokenizer.ggml.token_type`, control tokens (3) become special added tokens and
user-defined ones (4, e.g. `<think>`) non-special added tokens. Without it (the ds4 test files),
a token is an added token when BPE cannot produce it: longer than one character and the result
of no merge. On DeepSeek V4's vocabulary that rule finds exactly its 1,283 added tokens. Only
the bos/eos/padding tokens are then marked special, so decoding never drops text such as
`</think>` that DeepSeek marks non-special.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from ds4_vllm.model.gguf_metadata import GgufTokenizerMetadata

# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre`, applied as ordered splits.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "joyai-llm": (
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
        r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
}

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4


def added_token_ids(meta: GgufTokenizerMetadata) -> dict[int, bool]:
    """{token id: special} for the tokens matched whole before BPE (see the module docstring)."""
    if meta.token_types is not None:
        return {
            i: t == TOKEN_TYPE_CONTROL
            for i, t in enumerate(meta.token_types)
            if t in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
        }
    merged = {m.replace(" ", "", 1) for m in meta.merges}
    special = {meta.bos_token_id, meta.eos_token_id, meta.padding_token_id}
    return {i: i in special for i, tok in enumerate(meta.tokens) if len(tok) > 1 and tok not in merged}


def build_tokenizer(meta: GgufTokenizerMetadata) -> Tokenizer:
    """The `tokenizers.Tokenizer` the metadata describes (byte-level BPE only)."""
    if meta.model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model = {meta.model!r}: only byte-level BPE ('gpt2') is supported")
    splits = PRE_TOKENIZER_SPLITS.get(meta.pre or "")
    if splits is None:
        raise ValueError(
            f"tokenizer.ggml.pre = {meta.pre!r} is not known; supported: {sorted(PRE_TOKENIZER_SPLITS)}"
        )
    vocab = {tok: i for i, tok in enumerate(meta.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in meta.merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    added = added_token_ids(meta)
    tokenizer.add_tokens(
        [
            AddedToken(meta.tokens[i], special=special, normalized=False)
            for i, special in sorted(added.items())
        ]
    )
    return tokenizer


def hf_tokenizer_json(meta: GgufTokenizerMetadata) -> str:
    """`tokenizer.json` text for the embedded vocabulary."""
    return build_tokenizer(meta).to_str()


def write_hf_tokenizer(meta: GgufTokenizerMetadata, dest: Path) -> Path:
    """Write `tokenizer.json` and `tokenizer_config.json` (bos/eos, chat template) into `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "tokenizer.json").write_text(hf_tokenizer_json(meta), encoding="utf-8")

    def token(i: int | None) -> str | None:
        return None if i is None else meta.tokens[i]

    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": token(meta.bos_token_id),
        "eos_token": token(meta.eos_token_id),
        "pad_token": token(meta.padding_token_id if meta.padding_token_id is not None else meta.eos_token_id),
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
    }
    if meta.chat_template:
        config["chat_template"] = meta.chat_template
    (dest / "tokenizer_config.json").write_text(
        json.dumps(config, indent=2, ensure_ascii=False) + "\n", "utf-8"
    )
    return dest
