"""The tokenizer vLLM loads for ds4 (`Ds4TokenizerLoader`) loads quietly and gives the engine's ids.

transformers warns at every load that the tokenizer.json has Mistral's "incorrect regex pattern"
and suggests `fix_mistral_regex=True` (issue 24). For DeepSeek's pre-tokenizer that is a false
alarm: the suggested fix changes how digits split. The loader says False; these tests show the
ids are those of `Ds4Tokenizer` (the engine's rules, checked against the engine's own .kv files in
tests/chat) on code, CJK, numbers, whitespace runs, contractions and URLs, through both paths
vLLM encodes text with (`encode`, `__call__`; `Ds4HfTokenizer` routes them to the engine's
rules, not to the Rust pre-tokenizer), and that the suggested fix would have changed them.
"""

from __future__ import annotations

import pytest

from ds4_vllm.chat.tokenizer import default_tokenizer
from ds4_vllm.model.default_model import default_model_dir
from ds4_vllm.serving.tokenizer import Ds4HfTokenizer, Ds4TokenizerLoader

CORPUS = [
    "def f(x):\n    return x**2  # square\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    'fn main() -> Result<(), Box<dyn Error>> {\n\tprintln!("{}", 42);\n}',
    "你好，世界！这是一个测试。",
    "日本語のテキストと한국어 텍스트",
    "3.14159 and 1,000,000 and 2026-12-05T01:46:00Z",
    "0x7fff_ffff 1e-10 -273.15 ½ ²",
    "    \t\t  many   spaces\n\n\n\nand newlines  \n",
    "I'm sure they'll say you've done it, won't they? We'd've.",
    "https://example.com/path?q=1&r=two#frag and www.x.org/a_b-c",
    "HELLO World, CamelCaseIdentifiers and snake_case_names",
    "Ünïcödé àccents — em dash … ellipsis",
    "emoji 🚀🔥 mixed",
    '$ git commit -m "fix: the bug" && ls -la ./src/*.py',
]


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


@pytest.mark.parametrize("text", CORPUS)
def test_every_encode_path_gives_the_engine_rules_ids(model_dir: str, text: str) -> None:
    loaded = Ds4TokenizerLoader.from_pretrained(model_dir)
    engine_ids = default_tokenizer().encode(text)
    assert loaded.encode(text) == engine_ids
    assert loaded(text).input_ids == engine_ids


def test_the_suggested_fix_would_change_the_ids_of_numbers(model_dir: str) -> None:
    fixed = Ds4HfTokenizer.from_pretrained(model_dir, fix_mistral_regex=True)
    text = "3.14159 and 1,000,000 and 2026-12-05T01:46:00Z"
    assert fixed.backend_tokenizer.encode(text, add_special_tokens=False).ids != default_tokenizer().encode(
        text
    )
