"""Cache policy on top of `ds4_vllm.kvc`: settings, save points, the checkpoint store, traces.

Pure Python + numpy (+ fsspec for remote URLs); no torch, no vLLM (a test enforces it).
See docs/connector.md, "Cache policy and flags".
"""

from .checkpoint_store import Admission, CheckpointStore, StoreResult
from .options import StoreConfigError, StoreOptions, default_disk_dir
from .policy import (
    AnswerEnd,
    SaveDecision,
    answer_comes_back,
    answer_start,
    answer_start_save,
    chat_anchor,
    cold_store_len,
    continued_due,
    finished_save,
    plan_prefill_saves,
    reasoning_open,
    store_len,
)
from .records import LoadFailure, LoadReport, LookupOutcome, WriteReport, WriteTicket, tokens_digest
from .stats import StoreStats
from .trace import CacheDecision, TraceWriter
from .write_queue import WriteQueue
from .writer import CheckpointWriter

__all__ = [
    "Admission",
    "AnswerEnd",
    "CheckpointWriter",
    "LoadReport",
    "WriteQueue",
    "WriteReport",
    "WriteTicket",
    "CacheDecision",
    "CheckpointStore",
    "LoadFailure",
    "LookupOutcome",
    "SaveDecision",
    "StoreConfigError",
    "StoreOptions",
    "StoreResult",
    "StoreStats",
    "TraceWriter",
    "answer_comes_back",
    "answer_start",
    "answer_start_save",
    "chat_anchor",
    "cold_store_len",
    "continued_due",
    "default_disk_dir",
    "finished_save",
    "plan_prefill_saves",
    "reasoning_open",
    "store_len",
    "tokens_digest",
]
