#!/usr/bin/env bash
# Set up .venv if needed, then serve the default model: vllm serve --model ds4 on 127.0.0.1:$PORT.
# Extra arguments go to `vllm serve` (e.g. --max-model-len 4096 --dtype float32).
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec vllm serve --model ds4 --host 127.0.0.1 --port "${PORT:-8000}" "$@"
