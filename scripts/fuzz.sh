#!/usr/bin/env bash
# Coverage-guided fuzzing of the KVC reader and the directory scan (docs/reliability/files.md):
#   scripts/fuzz.sh [TARGET ...] [--runs N] [--seed S] [--out DIR] [--json FILE]
# Default: every target, 100000 cases each. Exit 1 when any target found a crashing input.
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$DS4_ROOT"
export PYTHONPATH="$DS4_ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec python -m tests.fuzz.campaign "$@"
