"""`ds4-kv` as users run it: real subprocesses for the main paths, main() for the rest."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ds4_vllm.cli import kv as cli
from ds4_vllm.cli.kv_format import display_width
from ds4_vllm.kvc import touch_checkpoint, write_checkpoint
from tests.kvc.kvc_helpers import MICRO, new_header, random_payload, run_cli, tool_entries


def make(d: Path, text: bytes, tokens: int = 9, tools: int = 0, now: int = 1_767_225_600) -> Path:
    data = random_payload(MICRO, tokens, np.random.default_rng(tokens), ctx_size=4096)
    return write_checkpoint(
        d, text, new_header(tokens, ctx_size=4096, now=now), data, tool_entries(tools), fsync=False
    )


def test_ls_table_escapes_and_fits(tmp_path: Path) -> None:
    make(tmp_path, b"line one\nline two\x1b[31mred\x07" + "｜wide｜".encode() * 30, tokens=20)
    make(tmp_path, b"short", tokens=5)
    proc = run_cli("ls", str(tmp_path), "--sort", "tokens")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.decode().splitlines()
    assert lines[0].split()[:3] == ["SHA1", "TOKENS", "REASON"]
    assert "line one\\nline two\\x1b[31mred\\x07" in lines[2]
    assert "\x1b" not in proc.stdout.decode()
    assert all(display_width(line) <= 160 for line in lines)
    assert lines[1].split()[1] == "5" and lines[2].split()[1] == "20"
    assert "2 checkpoints" in lines[-1] and "total" in lines[-1]
    rev = run_cli("ls", str(tmp_path), "--sort", "tokens", "--reverse").stdout.decode().splitlines()
    assert rev[1].split()[1] == "20"


def test_ls_narrow_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    make(tmp_path, b"some text " * 20)
    monkeypatch.setenv("COLUMNS", "50")
    assert cli.main(["ls", str(tmp_path)]) == 0
    assert all(display_width(line) <= 50 for line in capsys.readouterr().out.splitlines())


def test_inspect_text_and_json(tmp_path: Path) -> None:
    path = make(tmp_path, b"hello", tools=2)
    proc = run_cli("inspect", str(path), check=True)
    text = proc.stdout.decode()
    assert "reason:         1 (cold)" in text and "ktm:            2 entries" in text
    doc = json.loads(run_cli("inspect", "--json", str(path), check=True).stdout)
    assert doc["tokens"] == 9 and doc["ktm_ids"] == [e.tool_id.decode() for e in tool_entries(2)]
    assert doc["payload_header"]["n_layer"] == MICRO.n_layer and doc["text_preview"] == "hello"
    assert doc["ext_flag_names"] == ["tool-map"] and doc["name_matches_text"] is True


def test_verify_reports_each_bad_file(tmp_path: Path) -> None:
    good = make(tmp_path, b"good")
    trunc = make(tmp_path, b"truncated")
    trunc.write_bytes(trunc.read_bytes()[:-3])
    misnamed = make(tmp_path, b"misnamed")
    misnamed.rename(tmp_path / ("f" * 40 + ".kv"))
    junk = make(tmp_path, b"junk")
    with open(junk, "ab") as fp:
        fp.write(b"xx")
    proc = run_cli("verify", str(tmp_path), str(tmp_path / "missing.kv"))
    assert proc.returncode == 1
    lines = proc.stdout.decode().splitlines()
    bad = [line for line in lines if line.startswith("BAD")]
    assert len(bad) == 4
    joined = "\n".join(bad)
    assert "payload_bytes at byte 40" in joined
    assert "file_name at byte 52" in joined and "unexpected bytes" in joined and "missing.kv" in joined
    assert good.name not in joined
    assert run_cli("verify", str(good)).returncode == 0


def test_gc_applies_eviction_rule(tmp_path: Path) -> None:
    cheap = make(tmp_path, b"cheap", tokens=3)
    rich = make(tmp_path, b"rich", tokens=300)
    hot = make(tmp_path, b"hot", tokens=3)
    for _ in range(50):
        touch_checkpoint(hot)
    sizes = {p: p.stat().st_size for p in (cheap, rich, hot)}
    budget_mb = (sizes[rich] + sizes[hot]) / 2**20
    dry = run_cli("gc", str(tmp_path), "--max-mb", repr(budget_mb), "--dry-run", check=True).stdout.decode()
    assert f"would remove {cheap.name}" in dry and cheap.exists()
    real = run_cli("gc", str(tmp_path), "--max-mb", repr(budget_mb), check=True).stdout.decode()
    assert f"removed {cheap.name}" in real and "removed 1 of 3" in real
    assert not cheap.exists() and rich.exists() and hot.exists()


def test_rm_and_text(tmp_path: Path) -> None:
    text = "caf\u00e9 \x00 bytes\n".encode()
    path = make(tmp_path, text)
    out = run_cli("text", str(path), check=True).stdout
    assert out == text
    other = tmp_path / "notes.txt"
    other.write_text("keep")
    proc = run_cli("rm", str(path), str(other))
    assert proc.returncode == 1 and not path.exists() and other.exists()
    assert b"refusing" in proc.stderr


def test_errors_are_one_line_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / ("a" * 40 + ".kv")
    bad.write_bytes(b"KVC\x01\x02\x01" + bytes(50))
    for args in (["inspect", str(bad)], ["text", str(tmp_path / "nope.kv")], ["ls", str(tmp_path / "nodir")]):
        proc = run_cli(*args)
        assert proc.returncode != 0
        assert b"Traceback" not in proc.stderr and proc.stderr.startswith(b"ds4-kv: error")
        assert proc.stderr.count(b"\n") == 1
    assert b"tokens at byte 8" in run_cli("inspect", str(bad)).stderr
    assert run_cli("bogus").returncode == 2


def test_ls_mentions_invalid_files(tmp_path: Path) -> None:
    make(tmp_path, b"ok")
    (tmp_path / ("b" * 40 + ".kv")).write_bytes(b"garbage")
    proc = run_cli("ls", str(tmp_path))
    assert proc.returncode == 0 and b"1 invalid" in proc.stderr


def test_console_script_points_at_main() -> None:
    import tomllib

    from tests.kvc.kvc_helpers import REPO_ROOT

    scripts = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["ds4-kv"] == "ds4_vllm.cli.kv:main" and callable(cli.main)
