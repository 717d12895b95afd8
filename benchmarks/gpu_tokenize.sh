#!/usr/bin/env bash
# The prepared GPU script of the audio path: first w2v-BERT's attention kernels side by side on the whole model
# (benchmarks/bench_w2v_attention.py --device cuda, about 2.5 minutes on an H200), then steady-state audio
# seconds per second and MFU of tools.extract, tools.tokenize and the model alone on one GPU: a w2v-BERT-2.0-sized
# random model to layer 17 in bf16, this tree's encoder, its tokenize with the nearest codes (--beam_size 1),
# (with --before) an earlier tree, side by side, through
# benchmarks/bench_tokenize.py, with 3 passes of the model alone profiled (where its time goes: the kernels by
# kind, the share the GPU was busy) and 2 windows of each tool after its timed 15 s (the same, and the host's waits
# for the device), the tools' own account of their time by stage, and the user's alternative: transformers' own
# model in a plain loop over fixed batches of 64 x 10 s (bench_tokenize.py's `loop`). About 5 minutes on an H200
# with --before (15 s of steady-state work a run; the attention table before it, about 2.5). With --sweep, the
# pipeline's settings one at a time beside this tree's defaults (tools.tokenize with more decoding workers, passes
# of half and twice --batch_seconds, windows of half and twice --commit_seconds; graph mode is among the runs
# already), the table the GPU defaults (data/audio/pass_plan.py DEVICE_DEFAULTS) are picked from; with --company,
# benchmarks/codes_in_company.py: the share of code frames that differ between an utterance alone and in the
# tools' passes (a list, reversed, beside a long stranger, other window and pass sizes), about a minute.
#
#   bash benchmarks/gpu_tokenize.sh [--before DIR] [--skip-attention] [--sweep] [--company] [--wheels DIR]
#                                   [--cpu-only] [bench_tokenize.py flags...]
#
# --before DIR: a copy of the tree before the change, e.g. `mkdir .before && git archive BASE | tar -x -C .before`.
# --skip-attention: leave out the attention kernels' table.
# --wheels DIR (default .whl): wheels for what the machine lacks (soundfile, soxr and their cffi, pycparser;
#   vector-quantize-pytorch and its einx, frozendict, loguru, torch-einops-utils), made on a machine with an index:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
#     soundfile soxr cffi pycparser vector-quantize-pytorch==1.32.0 einx frozendict loguru torch-einops-utils
# --cpu-only: the same steps on this machine's CPU at toy sizes (a small model, half a minute of audio), to check
#   that the script runs.
# Results: $OUT/bench_tokenize_gpu.json and its log (OUT defaults to benchmarks/results).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
OUT=${OUT:-benchmarks/results}
before="" wheels=".whl" cpu_only=0 attention=1 sweep=0 company=0 extra=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --before) before=$2; shift 2 ;;
        --wheels) wheels=$2; shift 2 ;;
        --cpu-only) cpu_only=1; shift ;;
        --skip-attention) attention=0; shift ;;
        --sweep) sweep=1; shift ;;
        --company) company=1; shift ;;
        *) extra+=("$1"); shift ;;
    esac
done
if ! "$PYTHON" -c "import soundfile, soxr, vector_quantize_pytorch" 2>/dev/null; then
    if [[ ! -d $wheels ]]; then
        echo "soundfile, soxr or vector-quantize-pytorch is missing and there is no wheel folder $wheels" >&2
        exit 2
    fi
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$wheels"/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# this tree, its tokenize with the nearest codes (--beam_size 1), which gives what the codec's beam search costs,
# this tree in graph mode (--graphs on, which a CPU refuses), and the earlier tree's extraction and model alone
# (the device time goes to this tree's runs), in that order
repos=(--repo "after=$PWD" --tool_flags "after=--compile off")
repos+=(--repo "nearest=$PWD" --tool_flags "nearest=--compile off --beam_size 1" --label_modes "nearest=tokenize")
[[ $cpu_only == 0 ]] && repos+=(--repo "graphs=$PWD" --tool_flags "graphs=--compile off --graphs on"
                                --label_modes "graphs=extract,tokenize")
[[ -n $before ]] && repos+=(--repo "before=$(cd "$before" && pwd)" --label_modes "before=extract,model")
if [[ $sweep == 1 ]]; then  # each setting alone against this tree's defaults (the `after` runs)
    if [[ $cpu_only == 1 ]]; then workers=2 half_pass=5 twice_pass=20 half_window=5 twice_window=20
    else workers=$(( $(nproc) - 1 )) half_pass=300 twice_pass=1200 half_window=1800 twice_window=7200; fi
    for setting in "workers=--num_workers $workers" "passes_half=--batch_seconds $half_pass" \
                   "passes_twice=--batch_seconds $twice_pass" "windows_half=--commit_seconds $half_window" \
                   "windows_twice=--commit_seconds $twice_window"; do
        label=${setting%%=*}
        repos+=(--repo "$label=$PWD" --tool_flags "$label=--compile off ${setting#*=}" --label_modes "$label=tokenize")
    done
fi
mkdir -p "$OUT"
if [[ $company == 1 ]]; then
    if [[ $cpu_only == 1 ]]; then
        PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/codes_in_company.py --cpu-only \
            --out "$OUT/codes_in_company_cpu_only.json" 2>&1 | tee "$OUT/codes_in_company_cpu_only.log"
    else
        PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/codes_in_company.py --device cuda \
            --out "$OUT/codes_in_company_gpu.json" 2>&1 | tee "$OUT/codes_in_company_gpu.log"
    fi
fi
if [[ $attention == 1 ]]; then
    if [[ $cpu_only == 1 ]]; then
        PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/bench_w2v_attention.py --cpu-only --rounds 1 --passes 1 \
            --out "$OUT/bench_w2v_attention_cpu_only.json" 2>&1 | tee "$OUT/bench_w2v_attention_cpu_only.log"
    else
        PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/bench_w2v_attention.py --device cuda \
            --out "$OUT/bench_w2v_attention_gpu.json" 2>&1 | tee "$OUT/bench_w2v_attention_gpu.log"
    fi
fi
if [[ $cpu_only == 1 ]]; then
    flags=(--device cpu --model small --layer 4 --precision fp32 --mixes 5s --audio_minutes 1 --base_minutes 0.5
           --commit_seconds 10 --repeats 1 --modes extract,model,tokenize,loop --loop_rows 2 --profile 1
           --work_seconds 0.01 --profile_tool 1 --out "$OUT/bench_tokenize_cpu_only.json")
    log=$OUT/bench_tokenize_cpu_only.log
else
    "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no GPU visible: use --cpu-only')"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv || true
    # a tmpfs keeps the dump's writing (GBs a second at these speeds) off a disk of unknown speed
    scratch=()
    free_gb=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print int($4 / 1048576)}')
    [[ ${free_gb:-0} -ge 48 ]] && scratch=(--scratch /dev/shm)
    # 40 hours listed (the same 10 minutes of distinct files again and again): enough for 15 s at any speed;
    # each run stops after 15 s of steady state (then 2 windows profiled)
    flags=(--device cuda --model w2v-bert-2.0 --layer 17 --precision bf16 --mixes 2-20s --audio_minutes 2400
           --base_minutes 10 --work_seconds 15 --repeats 1 --modes extract,model,tokenize,loop "${scratch[@]}"
           --profile 3 --profile_tool 2 --timeout 240 --out "$OUT/bench_tokenize_gpu.json")
    log=$OUT/bench_tokenize_gpu.log
fi
set -o pipefail
PYTHONUNBUFFERED=1 "$PYTHON" benchmarks/bench_tokenize.py "${flags[@]}" "${repos[@]}" "${extra[@]}" 2>&1 | tee "$log"
