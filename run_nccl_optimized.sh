#!/usr/bin/env bash
# Launch the RVQ trainer with a preset: one process, or torchrun over GPUs and nodes.
#
#   bash run_nccl_optimized.sh PRESET [trainer flags...]
#   bash run_nccl_optimized.sh doctor          # would a launch work here? (python -m training.doctor)
#
# Presets (defined once, in training/presets.py): basic, gpu_cache, prefetch, conservative.
# Trainer flags after the preset win over the preset's own.
# Environment: DATA_DIR (default: the built-in demo corpus), OUTPUT_DIR (default runs/PRESET),
# NPROC_PER_NODE (default: the visible GPUs; none: one process on CPU), NNODES, NODE_RANK,
# MASTER_ADDR, MASTER_PORT (default: a free port on one node, 29500 on several), RDZV_ENDPOINT
# (c10d rendezvous instead of a static master), RDZV_ID, MAX_RESTARTS (elastic restarts, resuming
# from the last checkpoint), OMP_NUM_THREADS (default: cores / ranks on this node), DRY_RUN=1 (print
# the environment and the command, run nothing), PYTHON (default python3).
# NCCL_* and TORCH_* variables you set win over the preset's.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PYTHON=${PYTHON:-python3}
# the user's own NCCL/TORCH settings, taken before this script exports anything
mapfile -t USER_VARS < <(compgen -e | grep -E '^(NCCL|TORCH)_' || true)
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}"

say() { echo "[run_nccl_optimized] $*" >&2; }
# bad input: exit 2 before anything is started or written
die() {
  say "$*"
  exit 2
}

usage() {
  echo "usage: bash run_nccl_optimized.sh PRESET [trainer flags...]" >&2
  echo "       bash run_nccl_optimized.sh doctor" >&2
  echo "presets:" >&2
  "$PYTHON" -m training.presets --list | while IFS=$'\t' read -r name about; do
    printf '  %-13s %s\n' "$name" "$about" >&2
  done
  echo "environment: DATA_DIR OUTPUT_DIR NPROC_PER_NODE NNODES NODE_RANK MASTER_ADDR MASTER_PORT RDZV_ENDPOINT" \
    "RDZV_ID MAX_RESTARTS OMP_NUM_THREADS DRY_RUN=1 PYTHON; see the comment at the top of this script" >&2
}

need_int() { # NAME VALUE MIN
  [[ $2 =~ ^[0-9]+$ ]] && ((10#$2 >= $3)) || die "$1=$2: expected a whole number >= $3"
}

if [[ $# -lt 1 ]]; then
  usage
  exit 2
fi
if [[ $1 == doctor ]]; then
  shift
  exec "$PYTHON" -m training.doctor "$@"
fi
PRESET=$1
shift

OUTPUT_DIR=${OUTPUT_DIR:-runs/$PRESET}
# the trainer takes the last --output_dir, so the user's flag wins over OUTPUT_DIR
run_dir=$OUTPUT_DIR
user_resume=""
user_args=("$@")
for ((i = 0; i < ${#user_args[@]}; i++)); do
  case ${user_args[i]} in
    --output_dir) run_dir=${user_args[i + 1]:-$run_dir} ;;
    --output_dir=*) run_dir=${user_args[i]#--output_dir=} ;;
    --resume) user_resume=${user_args[i + 1]:-} ;;
    --resume=*) user_resume=${user_args[i]#--resume=} ;;
  esac
done

if ! preset_lines=$("$PYTHON" -m training.presets "$PRESET" --output_dir "$run_dir" 2>/dev/null); then
  say "unknown preset '$PRESET'"
  usage
  exit 2
fi

# your variables that NCCL does not read, or that PyTorch renamed (the doctor explains them)
while IFS= read -r line; do
  [[ -n $line ]] && say "warning: $line"
done < <("$PYTHON" -m training.doctor --env)

# ---- environment: the preset's settings, unless you set them; yours are kept and named
env_names=()
preset_names=" "
flags=()
skip_value=0
trainer_env=()
while IFS=$'\t' read -r kind key value origin; do
  case "$kind" in
    about) say "preset $PRESET: $key" ;;
    flag)
      if [[ $key == --nccl_timeout && -n ${NCCL_TIMEOUT:-} ]]; then
        # your NCCL_TIMEOUT is the trainer's timeout, so it wins over the preset's flag
        say "keeping NCCL_TIMEOUT=$NCCL_TIMEOUT from your environment: the trainer's process-group timeout; the preset's --nccl_timeout is left out"
        preset_names+="NCCL_TIMEOUT "
        env_names+=(NCCL_TIMEOUT)
        skip_value=1
      elif ((skip_value)); then
        skip_value=0
      else
        flags+=("$key")
      fi
      ;;
    env | workaround)
      preset_names+="$key "
      env_names+=("$key")
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
    trainer_env)
      preset_names+="$key "
      trainer_env+=("$key=$value")
      if [[ $origin == yours ]]; then
        say "keeping $key=$value from your environment (the trainer's default otherwise)"
        env_names+=("$key")
      fi
      ;;
  esac
done <<<"$preset_lines"
for key in "${USER_VARS[@]}"; do
  if [[ $preset_names != *" $key "* ]]; then
    say "keeping $key=${!key} from your environment"
    env_names+=("$key")
  fi
done

# ---- ranks on this node
visible_gpus() {
  # no NVIDIA or AMD device node: no GPU, without paying for a torch import
  if ! compgen -G '/dev/nvidia[0-9]*' >/dev/null && [[ ! -e /dev/kfd ]]; then
    echo 0
    return
  fi
  "$PYTHON" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0
}
GPUS=$(visible_gpus)
if [[ -n ${NPROC_PER_NODE:-} ]]; then
  need_int NPROC_PER_NODE "$NPROC_PER_NODE" 1
  if ((GPUS > 0 && NPROC_PER_NODE > GPUS)); then
    die "NPROC_PER_NODE=$NPROC_PER_NODE but only $GPUS GPU(s) are visible${CUDA_VISIBLE_DEVICES+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}:" \
      "each rank needs its own GPU;" \
      "lower NPROC_PER_NODE, or unset it to use every visible GPU"
  fi
else
  NPROC_PER_NODE=$((GPUS > 0 ? GPUS : 1))
fi
if ((GPUS == 0 && NPROC_PER_NODE > 1)); then
  say "no GPU visible: $NPROC_PER_NODE ranks on the CPU, with gloo"
fi

# one rank's share of the cores, so that ranks and their threads do not oversubscribe
if [[ -z ${OMP_NUM_THREADS:-} ]]; then
  cores=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc 2>/dev/null || getconf _NPROCESSORS_ONLN)
  export OMP_NUM_THREADS=$((cores / NPROC_PER_NODE > 1 ? cores / NPROC_PER_NODE : 1))
  say "setting OMP_NUM_THREADS=$OMP_NUM_THREADS ($cores cores / $NPROC_PER_NODE rank(s) on this node)"
else
  say "keeping OMP_NUM_THREADS=$OMP_NUM_THREADS from your environment"
fi
env_names+=(OMP_NUM_THREADS)

# ---- nodes and restarts
NNODES=${NNODES:-1}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-}
MAX_RESTARTS=${MAX_RESTARTS:-0}
need_int MAX_RESTARTS "$MAX_RESTARTS" 0
if [[ -n $RDZV_ENDPOINT ]]; then
  [[ $NNODES =~ ^[1-9][0-9]*(:[1-9][0-9]*)?$ ]] || die "NNODES=$NNODES: expected N or MIN:MAX (elastic, with RDZV_ENDPOINT)"
  max_nodes=${NNODES#*:}
  ((${NNODES%%:*} <= max_nodes)) || die "NNODES=$NNODES: MIN is larger than MAX"
else
  need_int NNODES "$NNODES" 1
  max_nodes=$NNODES
fi

trainer_args=(--output_dir "$OUTPUT_DIR")
if [[ -n ${DATA_DIR:-} ]]; then
  trainer_args+=(--data_dir "$DATA_DIR")
fi
trainer_args+=("${flags[@]}")
if ((MAX_RESTARTS > 0)); then
  # an elastic restart starts every rank anew: continue from the last checkpoint in the output dir
  trainer_args+=(--resume auto)
  if [[ -n $user_resume && $user_resume != auto ]]; then
    say "warning: your --resume $user_resume wins over --resume auto: every restart starts from it again"
  fi
fi
trainer_args+=("$@")

if ((NPROC_PER_NODE <= 1 && max_nodes <= 1 && MAX_RESTARTS == 0)) && [[ -z $RDZV_ENDPOINT ]]; then
  cmd=("$PYTHON" "$HERE/rvq_seamless_gpu_cache_nccl.py" "${trainer_args[@]}")
else
  if [[ -z $RDZV_ENDPOINT ]]; then
    if ((max_nodes > 1)); then
      [[ -n ${MASTER_ADDR:-} ]] || die "NNODES=$NNODES needs MASTER_ADDR: node 0's address, reachable from every node (or set RDZV_ENDPOINT for a c10d rendezvous)"
      # every node must name the same port, so no free port is picked here
      MASTER_PORT=${MASTER_PORT:-29500}
    else
      MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
      MASTER_PORT=${MASTER_PORT:-$("$PYTHON" -c 'import socket; s=socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])')}
    fi
    need_int MASTER_PORT "$MASTER_PORT" 1
    ((MASTER_PORT <= 65535)) || die "MASTER_PORT=$MASTER_PORT: a port is at most 65535"
  fi
  if ((MAX_RESTARTS > 0)) && [[ -z $RDZV_ENDPOINT ]]; then
    # a static master keeps one store for all attempts, and a restarted group would read the
    # previous attempt's addresses from it: restarts go through a c10d rendezvous instead
    RDZV_ENDPOINT=$MASTER_ADDR:$MASTER_PORT
    say "MAX_RESTARTS=$MAX_RESTARTS: c10d rendezvous at $RDZV_ENDPOINT (MASTER_ADDR:MASTER_PORT), so that each restart starts afresh"
  fi
  cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC_PER_NODE" --nnodes "$NNODES")
  if [[ -n $RDZV_ENDPOINT ]]; then
    # every node must give the same id; the output dir, shared by the nodes, names the run
    RDZV_ID=${RDZV_ID:-${SLURM_JOB_ID:-rvq-$(printf '%s' "$run_dir" | tr -c 'A-Za-z0-9' '-')}}
    if [[ -n ${NODE_RANK:-} ]]; then
      say "NODE_RANK=$NODE_RANK is not used with a c10d rendezvous: it assigns node ranks itself"
    fi
    cmd+=(--rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "$RDZV_ID")
    # torchrun's shared store outlives a restart and keeps the old workers' addresses (pytorch/pytorch#167288);
    # unshared, rank 0 of each attempt starts a store of its own
    if [[ -z ${TORCH_DISABLE_SHARE_RDZV_TCP_STORE+x} ]]; then
      export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
      say "setting TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: each attempt's workers get a store of their own, on a free port of the first node"
      env_names+=(TORCH_DISABLE_SHARE_RDZV_TCP_STORE)
    fi
  else
    if ((max_nodes > 1)); then
      [[ -n ${NODE_RANK:-} ]] || die "NNODES=$NNODES needs NODE_RANK: 0 on the master node, 1..$((NNODES - 1)) on the others"
      need_int NODE_RANK "$NODE_RANK" 0
      ((NODE_RANK < NNODES)) || die "NODE_RANK=$NODE_RANK but NNODES=$NNODES: node ranks run from 0 to $((NNODES - 1))"
    fi
    cmd+=(--node_rank "${NODE_RANK:-0}" --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
  fi
  if ((MAX_RESTARTS > 0)); then
    # torchrun restarts every worker of this node when one fails, up to N times
    cmd+=(--max-restarts "$MAX_RESTARTS")
  fi
  cmd+=("$HERE/rvq_seamless_gpu_cache_nccl.py" "${trainer_args[@]}")
fi
if ((GPUS > 0)) && [[ ${cmd[1]} == -m ]]; then
  say "NCCL flight recorder: on a timeout each rank dumps its last collectives to $run_dir/nccl_traces/rank_<rank>"
fi
command_line=$(printf '%q ' "${cmd[@]}")

if [[ -n ${DRY_RUN:-} && ${DRY_RUN} != 0 ]]; then
  say "DRY_RUN=$DRY_RUN: printing the environment and the command; nothing is started"
  echo "# environment set or kept by the launcher"
  for key in PYTHONPATH ${CUDA_VISIBLE_DEVICES+CUDA_VISIBLE_DEVICES} "${env_names[@]}"; do
    printf 'export %s=%q\n' "$key" "${!key}"
  done
  echo "# set by the trainer when it creates an NCCL process group (values you set win)"
  for pair in "${trainer_env[@]}"; do
    echo "#   $pair"
  done
  echo "# command"
  echo "$command_line"
  exit 0
fi
say "running: $command_line"
exec "${cmd[@]}"
