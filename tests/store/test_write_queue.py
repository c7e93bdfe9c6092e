"""The writer queue: bounded by bytes, back-pressure before any drop, copies findable until written."""

from __future__ import annotations

import threading

from ds4_vllm.store import WriteQueue


def test_items_stay_findable_until_done() -> None:
    q = WriteQueue(max_bytes=100, wait_s=0.0)
    assert q.put("a", 40, "copy-a")[0]
    assert q.find("a") == "copy-a"
    assert q.take() == ("a", "copy-a")
    assert q.find("a") == "copy-a"  # being written: still served from memory
    q.done("a")
    assert q.find("a") is None


def test_full_queue_makes_the_step_wait_for_the_writer() -> None:
    q = WriteQueue(max_bytes=100, wait_s=30.0)
    assert q.put("a", 80, "copy-a")[0]
    taken = q.take()
    writer = threading.Timer(0.2, q.done, args=(taken[0],))  # the disk catches up a little later
    writer.start()
    accepted, waited = q.put("b", 80, "copy-b")  # 160 > 100: waits for "a" to be written
    writer.join()
    assert accepted and waited > 0
    assert q.find("a") is None and q.find("b") == "copy-b"


def test_a_save_is_dropped_only_after_the_wait() -> None:
    q = WriteQueue(max_bytes=100, wait_s=0.05)
    assert q.put("a", 80, "copy-a")[0]
    accepted, waited = q.put("b", 80, "copy-b")
    assert not accepted and waited >= 0.05
    assert q.find("b") is None


def test_one_oversized_checkpoint_fits_an_empty_queue() -> None:
    q = WriteQueue(max_bytes=10, wait_s=0.0)
    assert q.put("big", 1000, "copy")[0]
    assert not q.put("next", 1, "copy")[0]  # but nothing joins it until it is written


def test_same_checkpoint_twice_is_queued_once() -> None:
    q = WriteQueue(max_bytes=100, wait_s=0.0)
    assert q.put("a", 10, "first")[0] and q.put("a", 10, "second")[0]
    assert q.take() == ("a", "first")
    q.done("a")
    assert q.drain(1.0)


def test_close_ends_the_writer_after_the_last_item() -> None:
    q = WriteQueue(max_bytes=100, wait_s=0.0)
    q.put("a", 10, "copy")
    q.close()
    assert q.take() == ("a", "copy")
    assert q.take() is None
    assert not q.put("b", 10, "copy")[0]
