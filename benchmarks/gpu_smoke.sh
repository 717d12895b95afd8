#!/usr/bin/env bash
# The one command for a fresh GPU machine: install what is missing, then every smoke step.
#   bash benchmarks/gpu_smoke.sh [WHEEL_DIR] [gpu_smoke.py flags...]
# WHEEL_DIR: wheels for a machine with no index, made beforehand on one that has it:
#   pip download -d wheels vector-quantize-pytorch einops einx loguru torch-einops-utils tqdm --no-deps
#   pip download -d wheels soundfile soxr "transformers>=4.46" "safetensors>=0.4.5"   # the extraction steps
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
if [[ $# -gt 0 && -d "$1" ]]; then
    wheels=$1; shift
    if ! "$PYTHON" -c "import vector_quantize_pytorch, einops, einx, loguru, tqdm" 2>/dev/null; then
        "$PYTHON" -m pip install --no-index --find-links "$wheels" --no-deps "$wheels"/*.whl
    fi
    if ! "$PYTHON" -c "import soundfile, soxr, transformers" 2>/dev/null; then
        "$PYTHON" -m pip install --no-index --find-links "$wheels" soundfile soxr transformers safetensors || \
            echo "requirements-extract.txt not installed: the extraction steps will say SKIP"
    fi
fi
exec "$PYTHON" benchmarks/gpu_smoke.py "$@"
