#!/usr/bin/env bash
# Runs rankscope's GPU checks on a GPU machine (CUDA, torch 2.x on Python 3.12, Triton), from the
# repository root, with build-gpu/ made by tools/gpu/bundle.sh carried beside it:
#
#   tools/gpu/run_checks.sh [all|env|kernels|test|train|cpu]...     (default: all)
#
#   env      the machine: GPU, driver, torch, Triton, CPU
#   kernels  bench/gpu_bench.py kernels: sketch and fingerprint throughput against the
#            device-to-device copy, torch ops against the Triton kernels, and their agreement
#   test     tests/python/test_gpu.py: exact statistics on CUDA, the one-ulp nudge, and no
#            synchronization under torch.cuda.set_sync_debug_mode("error")
#   train    bench/gpu_bench.py train: a GPT-2-small-sized step, plain DDP against rankscope
#            against an in-band all_gather
#   cpu      build-gpu/bin/sketch_bench on the GPU machine's host CPU (a second machine for the
#            CPU sketch kernel's figures, docs/PERFORMANCE.md)
#
# Logs and JSON go to $OUT (default /tmp/rankscope-gpu); the exit status is the number of steps
# that failed.
set -u
cd "$(dirname "$0")/../.."
B="$PWD/build-gpu"
OUT="${OUT:-/tmp/rankscope-gpu}"
mkdir -p "$OUT"
if [[ ! -x "$B/bin/rankscope-collector" ]]; then
  echo "run_checks.sh: $B is missing: run tools/gpu/bundle.sh here and carry build-gpu" >&2
  exit 2
fi
export LD_LIBRARY_PATH="$B/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH="$B/python:$PWD/tests/python" RANKSCOPE_BUILD_DIR="$B" PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
steps=("$@")
[[ ${#steps[@]} -eq 0 || " ${steps[*]} " == *" all "* ]] && steps=(env kernels test train cpu)
failed=0

run() {  # run NAME TIMEOUT COMMAND...: logs to $OUT/NAME.txt, prints its tail
  local name=$1 limit=$2
  shift 2
  echo "== $name ($(date +%T))"
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  local rc=$?
  tail -n 40 "$OUT/$name.txt"
  echo "== $name: exit $rc"
  [[ $rc -eq 0 ]] || failed=$((failed + 1))
}

for s in "${steps[@]}"; do
  case $s in
    env)
      run env 60 bash -c "nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
        --format=csv; $PY -c 'import sys, torch; print(sys.version); print(\"torch\", \
        torch.__version__, \"cuda\", torch.version.cuda); import triton; print(\"triton\", \
        triton.__version__)'; lscpu | grep -E \"Model name|^CPU\\(s\\)|Thread|Socket|L3\"; \
        nproc; $PY -c 'from rankscope import _native; print(\"rankscope._native\", \
        _native.AGENT_VERSION)'" ;;
    kernels) run kernels 120 "$PY" bench/gpu_bench.py kernels --json "$OUT/kernels.json" ;;
    test) run test 200 "$PY" -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -rA ;;
    train) run train 150 "$PY" bench/gpu_bench.py train --json "$OUT/train.json" ;;
    cpu) run cpu 110 "$B/bin/sketch_bench" --isa=all --threads=1,2,4,8 --mib=512 --reps=5 ;;
    *) echo "run_checks.sh: unknown step $s" >&2; failed=$((failed + 1)) ;;
  esac
done
echo "run_checks.sh: $failed step(s) failed; logs in $OUT"
exit "$failed"
