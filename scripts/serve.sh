#!/usr/bin/env bash
# Set up .venv if needed, then serve the default model: vllm serve --model ds4 on 127.0.0.1:$PORT.
# Extra arguments go to `vllm serve` (e.g. --max-model-len 4096 --dtype float32).
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
# On CPU, vLLM otherwise reserves --gpu-memory-utilization (0.92) of the machine's RAM and refuses
# to start when less is free; the default model needs far less. Override by setting it yourself.
if [ "${DS4_VLLM_EXTRA:-cpu}" = cpu ] && ! command -v nvidia-smi >/dev/null 2>&1; then
    export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-2}"
fi
exec vllm serve --model ds4 --host 127.0.0.1 --port "${PORT:-8000}" "$@"
