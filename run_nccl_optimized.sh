#!/usr/bin/env bash
# Launch the RVQ trainer with a preset: one process, or torchrun over GPUs and nodes.
#
#   bash run_nccl_optimized.sh PRESET [trainer flags...]
#   bash run_nccl_optimized.sh doctor          # would a launch work here? (python -m tools.doctor)
#   bash run_nccl_optimized.sh --help          # the presets, the environment it reads, examples
#
# The presets are defined in training/presets.py, the environment variables and their rules in
# tools/launch_rules.py; --help lists both from there. Trainer flags after the preset win over the
# preset's own. This script only finds Python (PYTHON, else python3); tools/launch.py (python -m
# tools.launch) reads the rest, checks it, and replaces itself with the trainer, or runs torchrun and
# passes stop signals to this node's ranks.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m tools.launch "$@"
