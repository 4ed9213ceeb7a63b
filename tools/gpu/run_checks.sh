#!/usr/bin/env bash
# Runs rankscope's GPU checks on a GPU machine (CUDA, torch 2.x on Python 3.12, Triton), from the
# repository root, from the installed cp312 wheel: `./run wheel` here builds it into
# build/wheels/ (carry that folder); this script pip-installs it with --no-deps (no network there)
# into a virtual environment over the machine's own packages (its torch and Triton stay), then
# runs each step with that environment's Python and the wheel's rankscope-collector on PATH:
#
#   tools/gpu/run_checks.sh [all|env|kernels|test|train]...     (default: all)
#
#   env      the machine: GPU, driver, torch, Triton, CPU, and the installed rankscope (with
#            its CUDA sketch fatbin, or ABSENT when the wheel was built without nvcc)
#   kernels  bench/gpu_bench.py kernels: sketch and fingerprint throughput against the
#            device-to-device copy, torch ops against the Triton kernels and the CUDA C++
#            sketch kernel (rows "cuda"), and their agreement
#   test     tests/python/test_gpu.py: exact statistics on CUDA, the one-ulp nudge, no
#            synchronization under torch.cuda.set_sync_debug_mode("error"), and the CUDA C++
#            sketch kernel's bins against the torch ops'
#   train    bench/gpu_bench.py train: a GPT-2-small-sized step, plain DDP against rankscope
#            against an in-band all_gather
#
# The wheel is $RANKSCOPE_WHEEL, else build/wheels/rankscope-*-cp312-*.whl; the base Python
# $PYTHON (default python3); the environment $RANKSCOPE_GPU_VENV (default
# /tmp/rankscope-gpu-venv, made again each run). Without a GPU, `test` runs and skips (a dry run
# of the install). Logs and JSON go to $OUT (default /tmp/rankscope-gpu); the exit status is the
# number of steps that failed.
set -u
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/rankscope-gpu}"
VENV="${RANKSCOPE_GPU_VENV:-/tmp/rankscope-gpu-venv}"
WHEEL="${RANKSCOPE_WHEEL:-$(ls build/wheels/rankscope-*-cp312-*.whl 2>/dev/null | tail -n 1)}"
mkdir -p "$OUT"
if [[ -z "$WHEEL" || ! -f "$WHEEL" ]]; then
  echo "run_checks.sh: no cp312 wheel in build/wheels: run ./run wheel here and carry build/wheels" >&2
  exit 2
fi
rm -rf "$VENV"
if ! "${PYTHON:-python3}" -m venv --system-site-packages "$VENV" ||
  ! "$VENV/bin/python" -m pip install -q --no-input --no-deps --no-index "$WHEEL"; then
  echo "run_checks.sh: cannot install $WHEEL into $VENV" >&2
  exit 2
fi
PY="$VENV/bin/python"
# tests/python for the suites' helpers only: rankscope itself is the installed one
# (RANKSCOPE_TEST_INSTALLED, tests/python/conftest.py).
export PATH="$VENV/bin:$PATH" PYTHONPATH="$PWD/tests/python" RANKSCOPE_TEST_INSTALLED=1
export PYTHONUNBUFFERED=1
steps=("$@")
[[ ${#steps[@]} -eq 0 || " ${steps[*]} " == *" all "* ]] && steps=(env kernels test train)
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
        nproc; $PY -c 'import rankscope, rankscope._native; print(\"rankscope\", \
        rankscope.__version__, rankscope._native.__file__)'; $PY -c 'import os, rankscope; \
        p = os.path.join(os.path.dirname(rankscope.__file__), \"_sketch.fatbin\"); \
        print(\"cuda sketch fatbin\", p if os.path.exists(p) else \"ABSENT\")'; \
        rankscope-collector --version" ;;
    kernels) run kernels 180 "$PY" bench/gpu_bench.py kernels --json "$OUT/kernels.json" ;;
    test) run test 200 "$PY" -m pytest -q -p no:cacheprovider tests/python/test_gpu.py -rA ;;
    train) run train 150 "$PY" bench/gpu_bench.py train --json "$OUT/train.json" ;;
    *) echo "run_checks.sh: unknown step $s" >&2; failed=$((failed + 1)) ;;
  esac
done
echo "run_checks.sh: $failed step(s) failed; logs in $OUT"
exit "$failed"
