"""vLLM tokenizer mode `ds4`: the Hugging Face tokenizer, encoding exactly as the ds4 engine does.

vLLM's `hf` tokenizer matches all 1,283 added tokens of the DeepSeek V4 vocabulary in text and
pre-tokenizes with Unicode classes; the ds4 engine matches only its 7 specials and counts every
non-ASCII character as a letter (`ds4_vllm.chat.tokenizer`). Any difference changes the cache key
ids. So every text -> ids path (`encode`, `__call__`, `tokenize`) goes through `Ds4Tokenizer`.

Everything else stays the Hugging Face tokenizer of the same vocabulary: vLLM's fast incremental
detokenizer, structured outputs (xgrammar reads the HF tokenizer) and tool parsers need one, and
ids -> text is the same in both (byte-level BPE; specials are written as their text).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import BatchEncoding, TokenizersBackend
from vllm.tokenizers.hf import get_cached_tokenizer
from vllm.tokenizers.protocol import TokenizerLike

from ds4_vllm.chat.tokenizer import Ds4Tokenizer


def ds4_tokenizer_of(hf: TokenizersBackend) -> Ds4Tokenizer:
    """The engine tokenizer over the same vocabulary and merges as a Hugging Face tokenizer."""
    local = Path(str(hf.name_or_path)) / "tokenizer.json"
    if local.is_file():
        return Ds4Tokenizer.from_tokenizer_json(local)
    with tempfile.TemporaryDirectory() as tmp:  # a hub tokenizer: its tokenizer.json as loaded
        path = Path(tmp) / "tokenizer.json"
        path.write_text(hf.backend_tokenizer.to_str(), encoding="utf-8")
        return Ds4Tokenizer.from_tokenizer_json(path)


class Ds4HfTokenizer(TokenizersBackend):
    """A `TokenizersBackend` whose text -> ids paths are the ds4 engine's (`Ds4Tokenizer`).

    The engine never adds special tokens on its own (its rendered text holds them), so
    `add_special_tokens` adds nothing. Truncation, when vLLM asks for it, keeps
    `truncation_side`'s end, as the Hugging Face tokenizer would.
    """

    ds4: Ds4Tokenizer

    def _ids(self, text: str, truncation: bool | None, max_length: int | None) -> list[int]:
        ids = self.ds4.encode(text)
        if truncation and max_length is not None and len(ids) > max_length:
            ids = ids[len(ids) - max_length :] if self.truncation_side == "left" else ids[:max_length]
        return ids

    def encode(  # type: ignore[override]  # transformers' overloads; the ds4 tokenizer takes one text
        self,
        text: str,
        text_pair: str | None = None,
        add_special_tokens: bool = True,
        truncation: bool | None = None,
        max_length: int | None = None,
        **kwargs: Any,
    ) -> list[int]:
        if text_pair is not None:
            raise ValueError("the ds4 tokenizer encodes one text, not text pairs")
        return self._ids(text, truncation, max_length)

    def __call__(  # type: ignore[override]  # same: one text or a list of texts, no pairs
        self,
        text: str | Sequence[str],
        text_pair: str | None = None,
        add_special_tokens: bool = True,
        truncation: bool | None = False,
        max_length: int | None = None,
        **kwargs: Any,
    ) -> BatchEncoding:
        if text_pair is not None:
            raise ValueError("the ds4 tokenizer encodes one text, not text pairs")
        if kwargs.get("return_offsets_mapping"):
            raise ValueError("the ds4 tokenizer does not produce offset mappings")
        if isinstance(text, str):
            ids: Any = self._ids(text, truncation, max_length)
            mask: Any = [1] * len(ids)
        else:
            ids = [self._ids(t, truncation, max_length) for t in text]
            mask = [[1] * len(i) for i in ids]
        return BatchEncoding({"input_ids": ids, "attention_mask": mask})

    def tokenize(self, text: str, **kwargs: Any) -> list[str]:  # type: ignore[override]  # no pair
        return self.convert_ids_to_tokens(self.ds4.encode(text))

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        return 0


class Ds4TokenizerLoader(TokenizerLike):
    """The `TokenizerRegistry` entry of mode `ds4` (vLLM calls `from_pretrained`)."""

    @classmethod
    def from_pretrained(  # type: ignore[override]  # vLLM's loader signature, not transformers'
        cls,
        path_or_repo_id: str | Path,
        *args: Any,
        trust_remote_code: bool = False,
        revision: str | None = None,
        download_dir: str | None = None,
        **kwargs: Any,
    ) -> Ds4HfTokenizer:
        kwargs.pop("mistral_format", None)
        # transformers flags every tokenizer.json whose config lacks a 5.x `transformers_version`
        # as having Mistral's "incorrect regex" and suggests fix_mistral_regex=True. For
        # DeepSeek's pre-tokenizer that advice is wrong (it changes the ids of ordinary text,
        # tests/chat/test_tokenizer.py), so say False and keep the start-up log clean.
        kwargs.setdefault("fix_mistral_regex", False)
        hf = Ds4HfTokenizer.from_pretrained(
            path_or_repo_id,
            *args,
            trust_remote_code=trust_remote_code,
            revision=revision,
            cache_dir=download_dir,
            **kwargs,
        )
        if not isinstance(hf, Ds4HfTokenizer):
            raise TypeError(f"{path_or_repo_id}: expected a byte-level BPE tokenizer.json, got {type(hf)}")
        hf.ds4 = ds4_tokenizer_of(hf)
        return get_cached_tokenizer(hf)  # type: ignore[return-value]  # vLLM types the cached copy as its base class
