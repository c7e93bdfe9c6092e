"""The layers import one way only: every `import` in `ds4_vllm/` (function-level and TYPE_CHECKING
ones too) is read from the source and checked against the layer table.

`contracts` (names shared across processes) and `kvc` (the file format) import nothing of ours;
every layer may use `contracts`; `store` only `kvc`; `chat` only `kvc`; `model` no
store, connector or serving; `connector` no serving or cli; and no module inside a subpackage
imports the package root `ds4_vllm` (its `__init__` is the plugin entry point, the top).
The runtime checks that torch and vLLM stay out of the light layers are the per-layer
`test_*_imports.py`.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "ds4_vllm"

#: Subpackage -> the subpackages of ours it may import (besides itself).
ALLOWED: dict[str, frozenset[str]] = {
    "contracts": frozenset(),
    "kvc": frozenset(),
    "store": frozenset({"contracts", "kvc"}),
    "chat": frozenset({"contracts", "kvc"}),
    "model": frozenset({"contracts", "kvc", "chat"}),
    "connector": frozenset({"contracts", "kvc", "store", "chat", "model"}),
    "serving": frozenset({"contracts", "kvc", "store", "chat", "model", "connector"}),
    "cli": frozenset({"contracts", "kvc", "store", "chat", "model", "connector", "serving"}),
    "vllm_compat": frozenset({"contracts", "kvc", "store", "chat", "model", "connector", "serving", "cli"}),
}


def imported_modules(relative: Path, source: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import statement of the file `ds4_vllm/<relative>`, in line
    order; `from ds4_vllm import a` gives `ds4_vllm.a` (`a` may be a submodule), `from X import a` `X`."""
    parts = ("ds4_vllm", *relative.with_suffix("").parts)
    package = ".".join(parts[:-1])  # an __init__'s package is its own directory: the same rule
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, str(relative))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "ds4_vllm":
                out += [(node.lineno, f"ds4_vllm.{alias.name}") for alias in node.names]
            else:
                out.append((node.lineno, target))
    return sorted(out)


def layer_violations(relative: Path, source: str) -> list[str]:
    """What the file `ds4_vllm/<relative>` imports against the layer table, as `file:line: problem`."""
    if len(relative.parts) == 1:
        return []  # the package root is the top: it may import every layer
    layer = relative.parts[0]
    where = Path("ds4_vllm", relative)
    problems = []
    for line, target in imported_modules(relative, source):
        names = target.split(".")
        if names[0] != "ds4_vllm":
            continue
        if len(names) == 1 or not (PACKAGE / names[1]).is_dir():
            problems.append(
                f"{where}:{line}: imports the package root ({target}); import from the defining module"
            )
        elif names[1] != layer and names[1] not in ALLOWED[layer]:
            problems.append(f"{where}:{line}: layer {layer} imports {target}")
    return problems


def test_every_subpackage_is_in_the_layer_table() -> None:
    subpackages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert subpackages == set(ALLOWED)


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_only_layers_below_it(layer: str) -> None:
    problems = [
        problem
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for problem in layer_violations(path.relative_to(PACKAGE), path.read_text(encoding="utf-8"))
    ]
    assert problems == []


def test_the_checker_sees_upward_and_root_imports() -> None:
    """The rule itself: a root import, an upward import and a relative upward import are all found."""
    source = (
        "from ds4_vllm import EMBEDDED_GGUF_MODELS\n"
        "def f():\n"
        "    from ds4_vllm.serving.startup import serving_flags\n"
        "    from ..connector import connector\n"
        "    from ds4_vllm.kvc import header\n"
        "    import ds4_vllm\n"
    )
    problems = layer_violations(Path("model", "probe.py"), source)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "imports the package root (ds4_vllm.EMBEDDED_GGUF_MODELS); import from the defining module",
        "layer model imports ds4_vllm.serving.startup",
        "layer model imports ds4_vllm.connector",
        "imports the package root (ds4_vllm); import from the defining module",
    ]
