#!/usr/bin/env bash
# Set up .venv if needed, then run the test suite: scripts/test.sh [pytest args], e.g. -m "not slow".
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
cd "$DS4_ROOT"
# Tests never need the Hugging Face hub; offline mode avoids network waits on CI machines.
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
exec python -m pytest "$@"
