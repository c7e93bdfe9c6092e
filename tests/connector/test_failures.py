"""Issue 4: every disk failure degrades to recomputation, never to a wrong answer or a dead engine.

One engine (in-process, so a fault can be injected between lookup and load) serves
five conversations on a small tmpfs. After each first turn its checkpoints are
damaged in a different way; the follow-up must still answer exactly as an engine
without the connector.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.model.engine_helpers import ds4disk_config, greedy, make_engine, random_prompts, shutdown_engine

pytestmark = [pytest.mark.slow, pytest.mark.reliability]

MAX_TOKENS = 6
CASES = ["corrupt", "truncated", "removed", "swapped", "disk_full", "read_only"]


def _mount(*args: str) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory):
    path = tmp_path_factory.mktemp("tmpfs")
    if not _mount("-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(path)):
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield path
    _mount("-o", "remount,rw", str(path))
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.fixture(scope="module")
def conversations():
    prompts = random_prompts([700 + 10 * i for i in range(len(CASES))], seed=9)
    tails = random_prompts([12] * len(CASES), seed=10)
    llm = make_engine(enable_prefix_caching=False)
    try:
        firsts = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(MAX_TOKENS))
        follow_ups = [
            p + list(o.outputs[0].token_ids) + t for p, o, t in zip(prompts, firsts, tails, strict=True)
        ]
        expected = llm.generate([{"prompt_token_ids": f} for f in follow_ups], greedy(MAX_TOKENS))
    finally:
        shutdown_engine(llm)
    return {
        case: {
            "prompt": p,
            "first": list(f.outputs[0].token_ids),
            "follow_up": fu,
            "expected": list(e.outputs[0].token_ids),
        }
        for case, p, f, fu, e in zip(CASES, prompts, firsts, follow_ups, expected, strict=True)
    }


@pytest.fixture(scope="module")
def engine(tmpfs, conversations):
    # After `conversations`: an in-process engine leaves its connector registered in this process.
    old = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process
    config = ds4disk_config(tmpfs)
    llm = make_engine(kv_transfer_config=config, enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30)
    yield llm
    shutdown_engine(llm)
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()  # the in-process worker registered its connector globally
    if old is None:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = old


def answer(llm, prompt):
    return llm.generate([{"prompt_token_ids": prompt}], greedy(MAX_TOKENS))[0]


def checkpoints(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.kv"))


def first_turn(engine, tmpfs, case: dict) -> list[Path]:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    before = set(checkpoints(tmpfs))
    out = answer(engine, case["prompt"])
    assert list(out.outputs[0].token_ids) == case["first"]
    answer(engine, [1])  # one more step copies the finished request's state
    assert get_kv_transfer_group().worker.queue.drain(60), "the writer should finish"  # in-process worker
    answer(engine, [1])  # and one more reports the write to the scheduler half
    written = [p for p in checkpoints(tmpfs) if p not in before]
    assert written, "the first turn should leave checkpoints"
    return written


def inject_after_lookup(monkeypatch, damage) -> list[str]:
    """Call ``damage(path)`` on the file a request was told to load, between lookup and load."""
    from ds4_vllm.connector import scheduler as scheduler_module

    original = scheduler_module.Ds4DiskScheduler.update_state_after_alloc
    damaged: list[str] = []

    def damage_after_lookup(self, request, blocks, num_external_tokens):
        original(self, request, blocks, num_external_tokens)
        pending = self.pending_loads.get(request.request_id)
        if pending is not None and pending.outcome.path not in damaged:
            damage(pending.outcome.path)
            damaged.append(pending.outcome.path)

    monkeypatch.setattr(scheduler_module.Ds4DiskScheduler, "update_state_after_alloc", damage_after_lookup)
    return damaged


def test_corrupt_file_is_quarantined_and_recomputed(engine, tmpfs, conversations):
    case = conversations["corrupt"]
    for path in first_turn(engine, tmpfs, case):
        data = bytearray(path.read_bytes())
        text_bytes = int.from_bytes(data[48:52], "little")
        data[52 + text_bytes : 52 + text_bytes + 4] = b"XXXX"  # the payload's "DSV4" magic
        path.write_bytes(bytes(data))
    out = answer(engine, case["follow_up"])
    assert list(out.outputs[0].token_ids) == case["expected"]
    assert out.num_cached_tokens == 0
    assert list((tmpfs / "quarantine").glob("*")), "a corrupt checkpoint is moved aside"


def test_truncated_file_is_recomputed(engine, tmpfs, conversations):
    case = conversations["truncated"]
    for path in first_turn(engine, tmpfs, case):
        os.truncate(path, path.stat().st_size // 2)
    out = answer(engine, case["follow_up"])
    assert list(out.outputs[0].token_ids) == case["expected"]
    assert out.num_cached_tokens == 0


def test_file_removed_between_lookup_and_load(engine, tmpfs, conversations, monkeypatch):
    case = conversations["removed"]
    first_turn(engine, tmpfs, case)
    removed = inject_after_lookup(monkeypatch, os.unlink)
    out = answer(engine, case["follow_up"])
    assert removed, "the follow-up should have found a checkpoint to load"
    assert list(out.outputs[0].token_ids) == case["expected"]


def test_file_swapped_between_lookup_and_load_is_refused(engine, tmpfs, conversations, monkeypatch, caplog):
    """Another process replaces the chosen file by a valid one of the same name and dims."""
    from ds4_vllm.kvc import PayloadData, open_checkpoint, write_checkpoint

    case = conversations["swapped"]
    first_turn(engine, tmpfs, case)

    def swap(path: str) -> None:
        with open_checkpoint(path) as ck:
            p = ck.payload
            tokens = np.array(p.tokens, dtype=np.uint32)
            tokens[len(tokens) // 2] += 1  # same text (name), same dims, other tokens
            other = PayloadData(
                p.header, tokens, np.array(p.logits), p.n_comp, p.n_index_comp, list(p.layers)
            )
            write_checkpoint(tmpfs, bytes(ck.text), ck.header, other, fsync=False)

    swapped = inject_after_lookup(monkeypatch, swap)
    with caplog.at_level(logging.WARNING, logger="ds4_vllm"):
        out = answer(engine, case["follow_up"])
    assert swapped, "the follow-up should have found a checkpoint to load"
    assert list(out.outputs[0].token_ids) == case["expected"]
    assert out.num_cached_tokens == 0
    refusals = [r.message for r in caplog.records if "load refused" in r.message]
    assert any("replaced since the lookup" in m for m in refusals), refusals


def store_failures(caplog) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING and "kv cache store failed" in r.getMessage()
    ]


def test_full_disk_skips_the_save_and_answers(engine, tmpfs, conversations, caplog):
    case = conversations["disk_full"]
    filler = tmpfs / "filler.bin"
    free = shutil.disk_usage(tmpfs).free
    with open(filler, "wb") as f:
        f.truncate(max(0, free - 64 * 1024))
        f.seek(0)
        f.write(b"\0" * max(0, free - 64 * 1024))  # tmpfs counts written pages only
    try:
        before = set(checkpoints(tmpfs))
        with caplog.at_level(logging.DEBUG, logger="ds4_vllm"):
            out = answer(engine, case["prompt"])
            answer(engine, case["prompt"][:-100])  # more saves that do not fit
            answer(engine, [1])
        assert list(out.outputs[0].token_ids) == case["first"]
        assert set(checkpoints(tmpfs)) == before, "nothing fits, nothing is left behind"
        assert not list(tmpfs.glob("*.tmp*"))
        failures = store_failures(caplog)
        assert len(failures) == 1 and "disk full" in failures[0], failures  # said once (issue 12)
    finally:
        filler.unlink()


def test_read_only_directory_skips_the_save_and_answers(engine, tmpfs, conversations, caplog):
    case = conversations["read_only"]
    assert _mount("-o", "remount,ro", str(tmpfs))
    try:
        before = set(checkpoints(tmpfs))
        with caplog.at_level(logging.DEBUG, logger="ds4_vllm"):
            out = answer(engine, case["prompt"])
            answer(engine, case["prompt"][:-100])  # more saves that cannot be written
            answer(engine, [1])
        assert list(out.outputs[0].token_ids) == case["first"]
        assert set(checkpoints(tmpfs)) == before
        failures = store_failures(caplog)
        assert len(failures) == 1 and "read-only" in failures[0], failures  # said once (issue 12)
    finally:
        assert _mount("-o", "remount,rw", str(tmpfs))


def test_unwritable_directory_stops_start_up_naming_the_flag(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("x")
    code = (
        "from vllm import LLM\n"
        "LLM(model='ds4', dtype='float32', enforce_eager=True, max_model_len=1024, kv_cache_memory_bytes=1 << 30,"
        " kv_transfer_config={'kv_connector': 'ds4disk', 'kv_role': 'kv_both', 'kv_load_failure_policy': 'recompute',"
        f" 'kv_connector_extra_config': {{'kv_disk_dir': {str(blocker / 'kv')!r}}}}})\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "--kv-disk-dir" in result.stderr + result.stdout
