"""The fuzz targets in CI: every corpus input replayed, then a short atheris run per target.

The 100,000-case runs per target are `heavy` (scripts/fuzz.sh, docs/reliability/files.md).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.fuzz.campaign import run_target
from tests.fuzz.seeds import CORPUS, seed_inputs
from tests.fuzz.targets import TARGETS

pytestmark = pytest.mark.reliability

#: Cases per target in CI: a few seconds each at the rates measured at idle (docs/reliability/files.md).
QUICK_RUNS = {"prefix": 3000, "checkpoint": 3000, "payload": 3000, "trailer": 3000, "scan": 1000}
HEAVY_RUNS = 100_000


def corpus_files(target: str) -> list[Path]:
    return sorted(p for p in (CORPUS / target).iterdir() if p.is_file())


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_corpus_replays_without_a_finding(target: str) -> None:
    """Seeds and every kept input (including each past crash) go through the target cleanly."""
    files = corpus_files(target)
    assert files, f"no corpus for {target}"
    for path in files:
        TARGETS[target](path.read_bytes())


def test_corpus_is_current_and_small() -> None:
    """The committed seeds are what `python -m tests.fuzz.seeds` builds, and the corpus stays small."""
    for target, inputs in seed_inputs().items():
        committed = {p.read_bytes() for p in (CORPUS / target).glob("seed-*")}
        assert committed == set(inputs), f"{target}: rebuild with python -m tests.fuzz.seeds"
    total = sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file())
    assert total < 2 * 1024 * 1024, total


@pytest.mark.timeout(300)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_short_fuzz_run_finds_nothing(target: str, tmp_path: Path) -> None:
    run = run_target(target, QUICK_RUNS[target], tmp_path, timeout_s=240)
    assert run.crashes == [], Path(run.log).read_text(errors="replace")[-4000:]
    assert run.returncode == 0 and run.cases == QUICK_RUNS[target], Path(run.log).read_text()[-4000:]


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_fuzz_100k_cases(target: str, tmp_path: Path) -> None:
    run = run_target(target, HEAVY_RUNS, tmp_path, timeout_s=3000)
    print(f"{target}: {run.cases} cases in {run.seconds} s ({run.cases_per_s}/s), cov {run.coverage}")
    assert run.crashes == [], Path(run.log).read_text(errors="replace")[-4000:]
    assert run.returncode == 0 and run.cases == HEAVY_RUNS


def test_rss_limit_counts_from_the_inherited_peak() -> None:
    """A fuzz process started by a large parent starts with the parent's peak RSS (Linux keeps
    `ru_maxrss` over fork and exec); its libFuzzer limit must leave the headroom above that."""
    import resource
    import subprocess
    import sys

    from tests.fuzz.campaign import REPO_ROOT
    from tests.fuzz.run import RSS_HEADROOM_MB

    ballast = bytearray(512 * 1024 * 1024)
    ballast[::4096] = b"\x01" * len(range(0, len(ballast), 4096))  # touch every page
    parent_peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    out = subprocess.run(
        [sys.executable, "-c", "from tests.fuzz.run import rss_limit_mb; print(rss_limit_mb())"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    del ballast
    assert int(out.stdout) >= parent_peak_mb - 64 + RSS_HEADROOM_MB


def test_scan_scratch_folders_are_removed(tmp_path: Path) -> None:
    """libFuzzer exits without Python's atexit; the runner removes the scan target's folders."""
    from tests.fuzz.targets import scratch_base

    base = Path(scratch_base() or tempfile.gettempdir())
    before = set(base.glob("ds4-fuzz-scan-*"))
    run = run_target("scan", 50, tmp_path, timeout_s=120)
    assert run.ok, Path(run.log).read_text(errors="replace")[-2000:]
    assert set(base.glob("ds4-fuzz-scan-*")) == before
