"""`atomic_output`: the one temp-then-rename writer of every product file."""

from __future__ import annotations

import os

import pytest

from ds4_vllm.kvc.atomic import atomic_output


def test_a_file_appears_whole_with_its_mode_and_no_temp_is_left(tmp_path) -> None:
    final = tmp_path / "model.gguf"
    with atomic_output(final, mode=0o644) as tmp:
        assert tmp.parent == tmp_path and tmp.name.startswith(".model.gguf.tmp.")
        tmp.write_bytes(b"new")
        assert not final.exists()
    assert final.read_bytes() == b"new"
    assert final.stat().st_mode & 0o777 == 0o644
    assert os.listdir(tmp_path) == ["model.gguf"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temp(tmp_path) -> None:
    final = tmp_path / "a.kv"
    final.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_output(final) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")
    assert final.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a.kv"]


def test_a_directory_written_second_keeps_the_first_writers(tmp_path) -> None:
    final = tmp_path / "tokenizer"
    with atomic_output(final, directory=True, first_writer_wins=True) as first:
        (first / "vocab.json").write_text("first")
        with atomic_output(final, directory=True, first_writer_wins=True) as second:
            (second / "vocab.json").write_text("second")
    # The inner block renamed first; the outer rename met a non-empty directory and kept it.
    assert (final / "vocab.json").read_text() == "second"
    assert os.listdir(tmp_path) == ["tokenizer"]


def test_without_first_writer_wins_a_lost_race_is_an_error(tmp_path) -> None:
    final = tmp_path / "model"
    final.mkdir()
    (final / "model.safetensors").write_bytes(b"x")
    with pytest.raises(OSError), atomic_output(final, directory=True) as tmp:
        (tmp / "model.safetensors").write_bytes(b"y")
    assert (final / "model.safetensors").read_bytes() == b"x"
    assert os.listdir(tmp_path) == ["model"]
