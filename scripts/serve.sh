#!/usr/bin/env bash
# Set up .venv if needed, then serve the product on 127.0.0.1:$PORT (default 8000):
#   ds4-vllm serve   = the embedded model `ds4` with ds4disk checkpoints in ~/.cache/ds4-vllm/kvcache
# Extra arguments go to `ds4-vllm serve` (any `vllm serve` flag, e.g. --max-model-len 4096;
# another model; --kv-disk-dir DIR; --no-kv-disk to serve without checkpoints).
# tcmalloc is preloaded when installed (Debian: libtcmalloc-minimal4): vLLM's CPU guide asks for
# it, and docs/benchmarks.md ("Preloaded libraries") shows what it gives here.
set -euo pipefail
# shellcheck source=scripts/setup.sh
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
if [ -z "${LD_PRELOAD:-}" ]; then
    for lib in /usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4 \
        /usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4; do
        if [ -e "$lib" ]; then
            export LD_PRELOAD="$lib"
            echo "serve.sh: preloading $lib (LD_PRELOAD)" >&2
            break
        fi
    done
fi
exec ds4-vllm serve --host 127.0.0.1 --port "${PORT:-8000}" "$@"
