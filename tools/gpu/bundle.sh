#!/usr/bin/env bash
# Builds, on this (Debian bookworm) machine, what the GPU machine needs to run rankscope, into one
# folder that travels there: build-gpu/ (ignored by git, under the 64 MiB a device call carries).
#
# The GPU machine has CUDA, torch 2.11 on Python 3.12, Triton, CMake and ninja, but no gRPC,
# protobuf or Abseil and no network. So the collector, the CLI and the Python extension are built
# here and their shared libraries travel beside them (build-gpu/lib, found through
# LD_LIBRARY_PATH there; glibc and libstdc++ stay the GPU machine's own, which are newer). The
# extension is built against a Python 3.12's headers (PYTHON312, default: pyenv's 3.12), because
# the GPU machine's torch runs on 3.12 and Debian's python3 is 3.11.
#
#   tools/gpu/bundle.sh            # then: device run, carry build-gpu, tools/gpu/run_checks.sh
#
# Layout of build-gpu/ (what tests/python/conftest.py expects of a build directory):
#   bin/rankscope-collector bin/rankscope bin/sketch_bench   stripped
#   python/rankscope/...  python/sitecustomize.py             the package, _native for cp312
#   lib/*.so*                                                 every non-libc dependency
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
PYTHON312="${PYTHON312:-$(ls -d /root/.pyenv/versions/3.12.*/bin/python3 2>/dev/null | tail -1)}"
BUILD="$ROOT/build-py312"
OUT="$ROOT/build-gpu"
JOBS="${JOBS:-2}"

if [[ -z "$PYTHON312" || ! -x "$PYTHON312" ]]; then
  echo "bundle.sh: no Python 3.12 with headers (set PYTHON312=/path/to/python3.12)" >&2
  exit 2
fi
echo "bundle.sh: building with $PYTHON312 into $BUILD" >&2
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DPython3_EXECUTABLE="$PYTHON312" >/dev/null
cmake --build "$BUILD" -j"$JOBS" --target rankscope_python rankscope-collector rankscope \
  sketch_bench >/dev/null

rm -rf "$OUT"
mkdir -p "$OUT/bin" "$OUT/lib"
cp -r "$BUILD/python" "$OUT/python"
find "$OUT/python" -name __pycache__ -prune -exec rm -rf {} +
for b in rankscope-collector rankscope sketch_bench; do
  strip -o "$OUT/bin/$b" "$BUILD/bin/$b"
done
strip "$OUT"/python/rankscope/*.so

# Every shared library the programs and the extension need, except the C runtime and the C++
# runtime the GPU machine brings itself (torch loads its own libstdc++ first; a second, older one
# on LD_LIBRARY_PATH could break it).
skip='^(linux-vdso|ld-linux|libc\.so|libm\.so|libdl\.so|libpthread\.so|librt\.so|libstdc\+\+\.so|libgcc_s\.so)'
for f in "$OUT"/bin/* "$OUT"/python/rankscope/_native*.so; do
  ldd "$f" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ ! "$name" =~ $skip ]]; then cp -L "$path" "$OUT/lib/$name"; fi
done
strip --strip-unneeded "$OUT"/lib/*.so* 2>/dev/null || true
du -sh "$OUT" >&2
