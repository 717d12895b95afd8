#!/usr/bin/env bash
# Launch the RVQ trainer with a preset: one process, or torchrun over GPUs and nodes.
#
#   bash run_nccl_optimized.sh PRESET [trainer flags...]
#   bash run_nccl_optimized.sh doctor          # would a launch work here? (python -m tools.doctor)
#
# Presets (defined once, in training/presets.py): basic, gpu_cache, prefetch, conservative.
# Trainer flags after the preset win over the preset's own.
# Environment: DATA_DIR (default: the built-in demo corpus), OUTPUT_DIR (default runs/PRESET),
# NPROC_PER_NODE (default: the visible GPUs; none: one process on CPU), NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (default: a free port on one node, 29500 on several), RDZV_ENDPOINT
# (c10d rendezvous instead of a static master), RDZV_ID, MAX_RESTARTS (elastic restarts, resuming
# from the last checkpoint), ALLOW_LOOPBACK_MASTER=1 (every node on this host, a drill: a loopback
# master is accepted), OMP_NUM_THREADS (default: cores / ranks on this node), DRY_RUN=1 (print
# the environment and the command, run nothing), PYTHON (default python3).
# NCCL_*, TORCH_* and GLOO_* variables you set win over the preset's.
# This script only finds Python; tools/launch.py (python -m tools.launch) reads all of the above, checks it,
# and replaces itself with the trainer, or runs torchrun and passes stop signals to this node's ranks.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
export PYTHON=${PYTHON:-python3}
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"
exec "$PYTHON" -m tools.launch "$@"
