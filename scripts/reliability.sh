#!/usr/bin/env bash
# The reliability suite of docs/reliability.md in full: every test marked `reliability` (heavy
# ones included), at the trial counts the doc reports. Extra arguments go to pytest, e.g.
#   scripts/reliability.sh -k crash          # only the crash trials
#   DS4_VLLM_CRASH_SEED=123 scripts/reliability.sh   # replay a printed seed
#   DS4_VLLM_RELIABILITY_TIMEOUT_S=7200 scripts/reliability.sh   # a per-test limit (default none)
# Figures (trials, peaks, seeds) are printed by the tests; -s keeps them in the output.
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$DS4_ROOT"
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
# Faults (docs/reliability/faults.md).
export DS4_VLLM_STORE_CRASH_TRIALS="${DS4_VLLM_STORE_CRASH_TRIALS:-500}"  # forked store writers killed
export DS4_VLLM_SHARED_DIR_SECONDS="${DS4_VLLM_SHARED_DIR_SECONDS:-120}"  # 6 store processes, one dir
export DS4_VLLM_CRASH_TRIALS="${DS4_VLLM_CRASH_TRIALS:-50}"                # real servers killed (-9)
export DS4_VLLM_SHARED_ROUNDS="${DS4_VLLM_SHARED_ROUNDS:-48}"              # conversations, 2 servers
# Hostile HTTP and load (docs/reliability/http.md).
export DS4_VLLM_HTTP_EXAMPLES="${DS4_VLLM_HTTP_EXAMPLES:-25}"    # schemathesis cases per operation
export DS4_VLLM_SOAK_REQUESTS="${DS4_VLLM_SOAK_REQUESTS:-960}"  # 16 clients, restarts between segments
# Files (docs/reliability/files.md): the fuzzing test runs 100,000 cases per target.
# At these counts one test runs for an hour or more (50 kill trials, the soak): the project's
# per-test limit of pyproject.toml (30 min, sized for CI) is lifted unless set here.
exec python -m pytest -m reliability -s -p no:cacheprovider \
    --timeout "${DS4_VLLM_RELIABILITY_TIMEOUT_S:-0}" "$@"
