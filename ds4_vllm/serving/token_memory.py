"""The API server's text-keyed reuse (`ds4_vllm.store.text_reuse`): one per process.

The renderer asks it for a prompt's ids (`Ds4Renderer.encode_prompt`), and the engine-output
hook (`ds4_vllm.serving.request_outputs.record_outputs`) feeds it every finished request's
prompt + output ids (`SequenceCollector`). With the ds4disk connector the checkpoint files of
its directory are a second source, the only one after a restart.
"""

from __future__ import annotations

import logging
from typing import Any

from ds4_vllm.store.text_reuse import CheckpointPrefixes, TextReuse, TokenizerLike, TokenMemory

logger = logging.getLogger(__name__)

_reuse: TextReuse | None = None


def text_reuse() -> TextReuse | None:
    """The process's reuse, once a ds4 renderer configured it."""
    return _reuse


def set_text_reuse(reuse: TextReuse | None) -> TextReuse | None:
    global _reuse
    _reuse = reuse
    return reuse


def configure_text_reuse(vllm_config: Any, tokenizer: TokenizerLike) -> TextReuse:
    """The memory for this server, reading the ds4disk directory when the connector is on.

    A renderer built again for the same tokenizer keeps the memory it has.
    """
    current = _reuse
    if current is not None and current.tokenizer is tokenizer:
        return current
    files = None
    kv = getattr(vllm_config, "kv_transfer_config", None)
    if kv is not None and kv.kv_connector == "ds4disk":
        from ds4_vllm.connector.connector import store_options
        from ds4_vllm.store.options import local_path

        options, _ = store_options(vllm_config)
        if options.is_local:
            files = CheckpointPrefixes(local_path(options.directory), tokenizer)
        else:
            logger.info(
                "text reuse: %s is not a local directory; only this process's turns are reused",
                options.directory,
            )
    reuse = TextReuse(tokenizer, TokenMemory(tokenizer), files)
    return set_text_reuse(reuse)  # type: ignore[return-value]


class SequenceCollector:
    """The full ids of one engine request's completions, from its stream of `RequestOutput`s.

    With `output_kind` DELTA (streaming) each output carries only the new tokens; otherwise
    each carries all of them so far.
    """

    def __init__(self, sampling_params: Any) -> None:
        kind = getattr(sampling_params, "output_kind", None)
        self.delta = getattr(kind, "name", None) == "DELTA"
        self.completions: dict[int, list[int]] = {}
        self.finished: dict[int, bool] = {}

    def note(self, output: Any) -> None:
        for completion in getattr(output, "outputs", None) or ():
            ids = list(getattr(completion, "token_ids", None) or ())
            index = getattr(completion, "index", 0)
            if self.delta:
                self.completions.setdefault(index, []).extend(ids)
            else:
                self.completions[index] = ids
            self.finished[index] = getattr(completion, "finish_reason", None) is not None
        if getattr(output, "finished", False):
            self.remember(list(getattr(output, "prompt_token_ids", None) or ()))

    def remember(self, prompt_ids: list[int]) -> None:
        reuse = _reuse
        if reuse is None or not prompt_ids:
            return
        for index, ids in self.completions.items():
            if self.finished.get(index, True):
                reuse.remember(prompt_ids + ids)
