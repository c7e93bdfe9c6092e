#!/usr/bin/env bash
# The model on a GPU without vLLM (issue 25): scripts/gpu_check.py's goal table, logged with tee so a
# timeout still leaves it. Runs on any machine with torch (no setup, no vLLM); prints "no GPU" and
# exits 0 where CUDA is absent. Args go to gpu_check.py, e.g. --out DIR, --device cpu.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="${GPU_CHECK_OUT:-gpu_check_results}"
mkdir -p "$out"
python3 scripts/gpu_check.py --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
