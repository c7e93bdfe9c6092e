"""TraceWriter: documented block format, escaping, concurrent writers never interleave."""

from __future__ import annotations

import threading
from pathlib import Path

from ds4_vllm.kvc import SaveReason
from ds4_vllm.store.policy import SaveDecision
from ds4_vllm.store.trace import CacheDecision, TraceWriter


def test_block_format(tmp_path: Path) -> None:
    path = tmp_path / "trace.log"
    with TraceWriter(str(path), clock=lambda: 0) as tw:
        tw.request(
            "req-1",
            CacheDecision(
                prompt_tokens=5000,
                prompt_bytes=20000,
                vllm_cached_tokens=1024,
                disk_cached_tokens=4096,
                disk_file="/c/ab.kv",
                disk_entry_tokens=4096,
                shared_tokens=4500,
                planned_saves=(SaveDecision(10240, SaveReason.CONTINUED),),
            ),
            extra={"kind": "chat"},
        )
        tw.request("req-2", CacheDecision(100, 400, disk_miss_reason="text diverges at byte 7\nfrom x"))
        tw.event("stored tokens=4096 file=/c/ab.kv")
    lines = path.read_text().splitlines()
    assert lines[0].startswith("===== request req-1 ") and lines[0].endswith(" =====")
    block = lines[: lines.index("", lines.index("--- cache decision ---"))]
    fields = dict(line.split(": ", 1) for line in block if ": " in line)
    assert fields["cache_source"] == "disk" and fields["cached_tokens"] == "4096"
    assert fields["disk_cache_file"] == "/c/ab.kv" and fields["planned_saves"] == "continued@10240"
    assert fields["kind"] == "chat" and fields["prompt_tokens"] == "5000"
    assert fields["shared_tokens"] == "4500"  # where it parts from the nearest known prompt
    text = path.read_text()
    assert text.count("shared_tokens") == 1  # only where a known checkpoint shares some text
    assert "cache_source: none" in text and "planned_saves: none" in text
    assert "disk_miss_reason: text diverges at byte 7\\nfrom x" in text  # one line per field
    assert lines[-1] == "--- trace: stored tokens=4096 file=/c/ab.kv ---"


def test_sources() -> None:
    assert CacheDecision(10, 10, vllm_cached_tokens=5).source == "vllm-memory"
    assert CacheDecision(10, 10).source == "none"


def test_concurrent_blocks_do_not_interleave(tmp_path: Path) -> None:
    path = tmp_path / "trace.log"
    tw = TraceWriter(str(path))

    def work(k: int) -> None:
        for i in range(50):
            tw.request(f"{k}-{i}", CacheDecision(i, i))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tw.close()
    blocks = path.read_text().split("===== request ")[1:]
    assert len(blocks) == 400
    assert all(b.count("--- cache decision ---") == 1 and b.count("cache_source:") == 1 for b in blocks)
