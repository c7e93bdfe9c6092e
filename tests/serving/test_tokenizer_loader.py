"""The tokenizer vLLM loads for ds4 (`Ds4TokenizerLoader`) loads quietly and gives the engine's ids.

transformers warns at every load that the tokenizer.json has Mistral's "incorrect regex pattern"
and suggests `fix_mistral_regex=True` (issue 24). For DeepSeek's pre-tokenizer that is a false
alarm: the suggested fix changes how digits split. The loader says False; these tests show the
ids equal the ds4 engine's own (`ds4 --dump-tokens`, recorded in
tests/data/engine_tokens/corpus.json by its record.py: code, CJK, numbers, whitespace runs,
contractions, URLs, special tokens) through both paths vLLM encodes text with (`encode`,
`__call__`), and that the suggested fix would have changed them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds4_vllm.model.default_model import default_model_dir
from ds4_vllm.serving.tokenizer import Ds4HfTokenizer, Ds4TokenizerLoader

ENGINE_TOKENS = Path(__file__).resolve().parents[1] / "data" / "engine_tokens" / "corpus.json"
CASES = json.loads(ENGINE_TOKENS.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(default_model_dir())


def test_loading_prints_no_regex_warning(model_dir: str) -> None:
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    transformers_logger = logging.getLogger("transformers")
    transformers_logger.addHandler(handler)
    try:
        Ds4TokenizerLoader.from_pretrained(model_dir)
    finally:
        transformers_logger.removeHandler(handler)
    assert not [r for r in records if "incorrect regex pattern" in r.getMessage()]


@pytest.fixture(scope="module")
def loaded(model_dir: str) -> Ds4HfTokenizer:
    return Ds4TokenizerLoader.from_pretrained(model_dir)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_every_encode_path_gives_the_engines_ids(loaded: Ds4HfTokenizer, case: dict) -> None:
    assert loaded.encode(case["text"]) == case["engine_ids"]
    assert loaded(case["text"]).input_ids == case["engine_ids"]


def test_the_suggested_fix_would_change_the_ids_of_numbers(model_dir: str) -> None:
    fixed = Ds4HfTokenizer.from_pretrained(model_dir, fix_mistral_regex=True)
    numbers = next(c for c in CASES if c["name"] == "numbers")
    assert (
        fixed.backend_tokenizer.encode(numbers["text"], add_special_tokens=False).ids != numbers["engine_ids"]
    )
