"""A vLLM logits processor for the real-client tests: every answer ends after a few tokens.

The tiny default model has random weights: it almost never samples its end-of-sentence token, so
every answer runs to ``max_tokens`` and an agent client reports an incomplete answer (Claude Code
exits 1 on "the response exceeded the output token maximum"). A trained model ends its thinking
and then its answer; this processor stands in for those two properties. Loaded by the test's
real server with vLLM's ``--logits-processors tests.e2e.answer_length:EndAnswersAfter``: a request
whose prompt opens a thinking block (ends with ``<think>``) gets ``</think>`` after
``DS4_TEST_ANSWER_TOKENS`` (default 24) output tokens, and every answer the end-of-sentence token
after as many more.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.interface import MoveDirectionality

ANSWER_TOKENS_ENV = "DS4_TEST_ANSWER_TOKENS"


class EndAnswersAfter(LogitsProcessor):
    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.limit = int(os.environ.get(ANSWER_TOKENS_ENV, "24"))
        self.eos = int(vllm_config.model_config.hf_config.eos_token_id)
        vocab = Tokenizer.from_file(str(Path(vllm_config.model_config.tokenizer) / "tokenizer.json"))
        self.think_start, self.think_end = vocab.token_to_id("<think>"), vocab.token_to_id("</think>")
        #: batch row -> (the request's live output ids, whether its prompt opened a thinking block)
        self.rows: dict[int, tuple[list[int], bool]] = {}

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for row in batch_update.removed:
            self.rows.pop(row, None)
        for row, _params, prompt, output in batch_update.added:
            self.rows[row] = (output, bool(prompt) and prompt[-1] == self.think_start)
        for a, b, direction in batch_update.moved:
            moved, other = self.rows.pop(a, None), self.rows.pop(b, None)
            if moved is not None:
                self.rows[b] = moved
            if direction == MoveDirectionality.SWAP and other is not None:
                self.rows[a] = other

    def _forced(self, output: list[int], thinking: bool) -> int | None:
        answer = output
        if thinking:
            if self.think_end not in output:
                return self.think_end if len(output) >= self.limit else None
            answer = output[output.index(self.think_end) + 1 :]
        return self.eos if len(answer) >= self.limit else None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for row, (output, thinking) in self.rows.items():
            token = self._forced(output, thinking)
            if token is not None:
                kept = logits[row, token].clone()
                logits[row] = float("-inf")
                logits[row, token] = kept
        return logits
