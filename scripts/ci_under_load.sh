#!/usr/bin/env bash
# Run CI (.ci/run) N times in a row from a clean clone of HEAD while a CPU-heavy process runs
# beside it, as issue 7 asks: races and round-off tolerances show up under load, not idle.
#
#   scripts/ci_under_load.sh [RUNS] [OUT_DIR]     (defaults: 3, /tmp/ds4-ci-under-load)
#
# The clone gets ../shared beside it (a link to this checkout's), like CI. The load is one
# busy Python process per run (one of the machine's cores), stopped when the run ends. Each
# run's output goes to OUT_DIR/run-K.log; OUT_DIR/summary.txt gets one line per run.
set -euo pipefail
runs="${1:-3}"
out="${2:-/tmp/ds4-ci-under-load}"
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rm -rf "$out"
mkdir -p "$out/work"
git clone --quiet "$root" "$out/work/main"
ln -s "$(cd "$root/../shared" && pwd)" "$out/work/shared"
: >"$out/summary.txt"
for k in $(seq 1 "$runs"); do
    python3 -c 'import time
end = time.monotonic() + 5400
while time.monotonic() < end:
    sum(i * i for i in range(10000))' &
    hog=$!
    start=$(date +%s)
    set +e
    (cd "$out/work/main" && CI=true bash .ci/run) >"$out/run-$k.log" 2>&1
    rc=$?
    set -e
    kill "$hog" 2>/dev/null || true
    wait "$hog" 2>/dev/null || true
    tail_line="$(grep -E '^[0-9]+ (passed|failed)|passed|failed' "$out/run-$k.log" | tail -1)"
    echo "run $k: exit $rc in $(($(date +%s) - start)) s: $tail_line" | tee -a "$out/summary.txt"
done
