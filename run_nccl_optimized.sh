#!/usr/bin/env bash
# Launch the RVQ trainer with a preset: one process, or torchrun over GPUs and nodes.
#
#   bash run_nccl_optimized.sh PRESET [trainer flags...]
#
# Presets (defined once, in training/presets.py): basic, gpu_cache, prefetch, conservative.
# Trainer flags after the preset win over the preset's own.
# Environment: DATA_DIR (default: the built-in demo corpus), OUTPUT_DIR (default runs/PRESET),
# NPROC_PER_NODE (default: the visible GPUs; none: one process on CPU), NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (default: a free port), PYTHON (default python3).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"

usage() {
  echo "usage: bash run_nccl_optimized.sh PRESET [trainer flags...]" >&2
  echo "presets:" >&2
  "$PYTHON" -m training.presets --list | while IFS=$'\t' read -r name about; do
    printf '  %-13s %s\n' "$name" "$about" >&2
  done
}

if [[ $# -lt 1 ]]; then
  usage
  exit 2
fi
PRESET=$1
shift
if ! preset_lines=$("$PYTHON" -m training.presets "$PRESET" 2>/dev/null); then
  echo "run_nccl_optimized.sh: unknown preset '$PRESET'" >&2
  usage
  exit 2
fi

say() { echo "[run_nccl_optimized] $*" >&2; }

flags=()
while IFS=$'\t' read -r kind key value; do
  case "$kind" in
    about) say "preset $PRESET: $key" ;;
    flag) flags+=("$key") ;;
    env | workaround)
      if [[ -n ${!key+x} ]]; then
        say "keeping $key=${!key} from your environment (preset: $value)"
      else
        export "$key=$value"
        if [[ $kind == workaround ]]; then
          say "setting $key=$value: a workaround from NCCL's troubleshooting guide, not a tuning"
        else
          say "setting $key=$value"
        fi
      fi
      ;;
  esac
done <<<"$preset_lines"

OUTPUT_DIR=${OUTPUT_DIR:-runs/$PRESET}
trainer_args=(--output_dir "$OUTPUT_DIR")
if [[ -n ${DATA_DIR:-} ]]; then
  trainer_args+=(--data_dir "$DATA_DIR")
fi
trainer_args+=("${flags[@]}" "$@")

if [[ -z ${NPROC_PER_NODE:-} ]]; then
  NPROC_PER_NODE=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
  [[ $NPROC_PER_NODE -ge 1 ]] || NPROC_PER_NODE=1
fi
NNODES=${NNODES:-1}

if [[ $NPROC_PER_NODE -le 1 && $NNODES -le 1 ]]; then
  cmd=("$PYTHON" "$HERE/rvq_seamless_gpu_cache_nccl.py" "${trainer_args[@]}")
else
  MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
  MASTER_PORT=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
  cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC_PER_NODE" --nnodes "$NNODES"
    --node_rank "${NODE_RANK:-0}" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
    "$HERE/rvq_seamless_gpu_cache_nccl.py" "${trainer_args[@]}")
fi
say "running: ${cmd[*]}"
exec "${cmd[@]}"
