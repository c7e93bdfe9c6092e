"""Record the ds4 engine's own tokenization of corpus.json's texts (issue 24).

    python tests/data/engine_tokens/record.py DS4_BINARY GGUF

DS4_BINARY is the engine's `ds4` CLI (../shared/tools/ds4-engine-build/build.sh builds it from
antirez/ds4; the tokenizer does not depend on the layer count), GGUF any ds4 GGUF file (the
vocabulary is the same in all; ../shared/tools/ds4-tiny-gguf/make.sh makes the small ones).
Each text goes through `ds4 --dump-tokens --prompt-file`, which tokenizes the file exactly as
written; the first line of its output is the id list. Rewrites corpus.json with the ids and the
engine's commit, and fails if the engine's answer cannot be read.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus.json"


def engine_ids(binary: str, gguf: str, text: str) -> list[int]:
    with tempfile.NamedTemporaryFile("wb", suffix=".txt") as prompt:
        prompt.write(text.encode("utf-8"))
        prompt.flush()
        out = subprocess.run(
            [binary, "-m", gguf, "--dump-tokens", "--prompt-file", prompt.name],
            capture_output=True,
            check=True,
            timeout=120,
        ).stdout
    first = out.split(b"\n", 1)[0].decode("ascii")
    ids = json.loads(first)
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise SystemExit(f"unexpected --dump-tokens output: {first[:200]!r}")
    return ids


def dump(corpus: dict) -> str:
    """One line per case, so a diff shows which text changed."""
    lines = [json.dumps(case, ensure_ascii=False) for case in corpus["cases"]]
    head = json.dumps(corpus["engine"], ensure_ascii=False)
    return '{"engine": ' + head + ', "cases": [\n' + ",\n".join(lines) + "\n]}\n"


def main() -> None:
    binary, gguf = sys.argv[1:3]
    corpus = json.loads(CORPUS.read_text(encoding="utf-8"))
    for case in corpus["cases"]:
        case["engine_ids"] = engine_ids(binary, gguf, case["text"])
    CORPUS.write_text(dump(corpus), encoding="utf-8")
    print(f"recorded {len(corpus['cases'])} texts into {CORPUS}")


if __name__ == "__main__":
    main()
