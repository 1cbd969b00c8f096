#!/usr/bin/env bash
# The GPU check (one command, under 10 minutes on one H100/H200 GPU).
#
#   bash tools/gpu_check.sh [OUT_DIR]      (default .gpu-check/, ignored by git)
#
# Runs from the source tree without installing (PYTHONPATH = packages/*/src), so a machine
# with PyTorch, Triton and transformers but no package registry can run it:
#   1. the tests with CUDA paths, on the CUDA accelerator: colossal-kernels (Triton compiled,
#      not interpreted), Gemini's chunks and placement, core's accelerator and launch;
#   2. benchmarks/gpu_check.py: fused Adam, norms, attention and a Llama training step against
#      plain PyTorch (eager and torch.compile) at one GPU;
#   3. benchmarks/main_job.py --quick and benchmarks/kernels.py --quick as they run on CPU
#      machines (the GPU machine's CPUs: the CPU Adam and the main job's goals there);
# then prints one markdown table (tools/gpu_report.py). Each step has its own time limit;
# a failing step is reported in the table and does not stop the others.
# Without a CUDA GPU it refuses in one line (exit 2).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_check: needs a CUDA GPU that PyTorch sees (torch.cuda.is_available() is False" \
         "with $PY here); run it on a machine with one"
    exit 2
fi
OUT=${1:-.gpu-check}
mkdir -p "$OUT"
: > "$OUT/steps.tsv"
PYTHONPATH="$(printf '%s:' "$PWD"/packages/*/src)${PYTHONPATH:-}"
export PYTHONPATH PYTHONUNBUFFERED=1 COLOSSAL_ACCELERATOR=cuda
unset TRITON_INTERPRET

step() {  # step NAME LIMIT_S CMD...: run, log to $OUT/NAME.log, record rc and seconds
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - start))" >> "$OUT/steps.tsv"
    tail -n 3 "$OUT/$name.log"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    > "$OUT/gpu.txt" 2>&1 || true
step pytest_kernels 150 "$PY" -m pytest -q -p no:cacheprovider packages/colossal-kernels/tests \
    --junitxml="$OUT/pytest_kernels.xml"
step pytest_cuda_paths 90 "$PY" -m pytest -q -p no:cacheprovider \
    packages/colossal-gemini/tests/test_chunk.py packages/colossal-gemini/tests/test_placement.py \
    packages/colossal-core/tests/test_accelerator_launch.py \
    --junitxml="$OUT/pytest_cuda_paths.xml"
step gpu_check_bench 180 "$PY" benchmarks/gpu_check.py --json "$OUT/gpu_check.json"
step kernels_bench 60 "$PY" benchmarks/kernels.py --quick --json "$OUT/kernels.json"
step main_job_bench 90 env COLOSSAL_ACCELERATOR=cpu "$PY" benchmarks/main_job.py --quick \
    --rounds 1 --json "$OUT/main_job.json"
"$PY" tools/gpu_report.py "$OUT"
