"""Serving a ds4 GGUF file with vLLM: `vllm serve /path/file.gguf`, `LLM(model="file.gguf")`.

vLLM 0.32 has no GGUF support of its own. Three public hooks cover it: the `ds4` config format
reads the file's `deepseek4.*` metadata (`Ds4GgufFile.config`), the `ds4_gguf` load format
(`register_model_loader`) streams its tensors into the model, and the tokenizer embedded in the
file is written once as a Hugging Face tokenizer directory. `prepare_gguf_engine_args` selects
all three for a GGUF path, so no flag is needed.

Imports vLLM: only `ds4_vllm.register()` and the engine-argument resolution import this module.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import psutil
from torch import nn
from tqdm import tqdm
from vllm.config import ModelConfig
from vllm.model_executor.model_loader import register_model_loader
from vllm.model_executor.model_loader.base_loader import BaseModelLoader

from ds4_vllm.kvc.atomic import atomic_output
from ds4_vllm.model.gguf_file import Ds4GgufFile
from ds4_vllm.model.gguf_tokenizer import write_hf_tokenizer
from ds4_vllm.model.quant import QuantizedWeight

LOAD_FORMAT = "ds4_gguf"
GGUF_MAGIC = b"GGUF"

logger = logging.getLogger(__name__)


def is_gguf_file(model: Any) -> bool:
    """True for a path to a regular file that starts with the GGUF magic."""
    if not isinstance(model, str | os.PathLike):
        return False
    path = Path(model)
    try:
        with open(path, "rb") as fp:
            return path.is_file() and fp.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _file_digest(path: Path) -> str:
    """Identity of a weight file for cache folders: resolved path, size and modification time."""
    stat = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def gguf_tokenizer_dir(path: str | Path) -> Path:
    """A Hugging Face tokenizer directory written from the file's `tokenizer.ggml.*` (once per file)."""
    from ds4_vllm.model.default_model import cache_root

    path = Path(path)
    dest = cache_root() / "tokenizers" / f"{path.stem}-{_file_digest(path)}"
    if not (dest / "tokenizer_config.json").is_file():
        gguf = Ds4GgufFile.open(path)
        meta = gguf.tokenizer_metadata()
        if meta is None:
            raise ValueError(f"{path}: the file embeds no tokenizer (tokenizer.ggml.*); pass --tokenizer DIR")
        dest.parent.mkdir(parents=True, exist_ok=True)
        with atomic_output(dest, directory=True, first_writer_wins=True) as tmp:
            write_hf_tokenizer(meta, tmp)
            # vLLM's tokenizer loader also reads the directory's config.
            (tmp / "config.json").write_text(gguf.config().to_json_string())
    return dest


def prepare_gguf_engine_args(engine_args: Any) -> None:
    """For a GGUF `model`: read its config and weights with our hooks and its embedded tokenizer."""
    if not is_gguf_file(engine_args.model):
        return
    if engine_args.config_format in ("auto", None):
        engine_args.config_format = "ds4"
    if engine_args.load_format in ("auto", None):
        engine_args.load_format = LOAD_FORMAT
    if engine_args.tokenizer in (None, engine_args.model):
        engine_args.tokenizer = str(gguf_tokenizer_dir(engine_args.model))


class Ds4GgufModelLoader(BaseModelLoader):
    """Streams a ds4 GGUF's tensors into `Ds4ForCausalLM`; quantized blocks stay memory-mapped."""

    def download_model(self, model_config: ModelConfig) -> None:
        """Local files only: nothing to download."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig) -> None:
        path = Path(model_config.model)
        started, rss_before = time.perf_counter(), _resident_bytes()
        gguf = Ds4GgufFile.open(path)
        names = gguf.native_names()
        total = path.stat().st_size
        with tqdm(total=total, unit="B", unit_scale=True, desc=f"Loading {path.name}") as bar:

            def stream():
                for count, (name, weight) in enumerate(gguf.tensors(), 1):
                    yield name, weight
                    bar.update(_nbytes(weight))
                    bar.set_postfix_str(f"{count}/{len(names)} tensors", refresh=False)

            model.load_weights(stream())
        # Packed weights stay memory-mapped: their pages become resident when first used, so the
        # growth here is mostly the tensors converted to the model's dtype.
        logger.info(
            "Loaded %s (%.2f GiB, %d tensors) in %.1f s; resident memory grew by %.2f GiB",
            path.name,
            total / 2**30,
            len(names),
            time.perf_counter() - started,
            (_resident_bytes() - rss_before) / 2**30,
        )


def _resident_bytes() -> int:
    return psutil.Process().memory_info().rss


def _nbytes(weight: Any) -> int:
    if isinstance(weight, QuantizedWeight):
        return weight.nbytes
    return weight.numel() * weight.element_size()


def register_gguf_loader() -> None:
    """Make `--load-format ds4_gguf` known to vLLM (`ds4_vllm.register()` calls it once per process)."""
    register_model_loader(LOAD_FORMAT)(Ds4GgufModelLoader)
