#!/usr/bin/env bash
# Build llama.cpp for the benchmarks and the oracle, from llama-cpp-python's PyPI sdist.
#
# Benchmark-only: nothing in the mixqrt package or its tests needs llama.cpp. The sdist vendors the
# whole llama.cpp tree, so one download gives both
#   * the Python bindings (`import llama_cpp`, used by compare_llamacpp.py, oracle_logits.py, ...),
#     installed into the current Python environment, and
#   * the command-line tools llama-server, llama-quantize and llama-perplexity, built with cmake into
#     $MIXQRT_LLAMA_DIR/build/bin (outside the repository).
# Point the benchmarks at the tools with  export MIXQRT_LLAMA_CPP_BIN=$MIXQRT_LLAMA_DIR/build/bin
#
#   benchmarks/llamacpp_build.sh                  # everything, into ~/.cache/mixqrt-llama
#   MIXQRT_LLAMA_DIR=/work/llama JOBS=4 benchmarks/llamacpp_build.sh
#   benchmarks/llamacpp_build.sh --python-only    # only the bindings, pip-built (its own libllama)
#   benchmarks/llamacpp_build.sh --tools-only     # only the binaries (and the shared libllama they use:
#       LLAMA_CPP_LIB_PATH=$DIR/build/bin PYTHONPATH=$DIR/src/llama_cpp_python-$VERSION make
#       `import llama_cpp` use it, no second compile; 12 min on 2 cores, the pip build over 25)
#   benchmarks/llamacpp_build.sh --lib-only       # quickest: libllama alone at -O1, no pip install;
#       then LLAMA_CPP_LIB_PATH=$DIR/build-lib/bin PYTHONPATH=$DIR/src/llama_cpp_python-$VERSION
#       (pip install diskcache) make `import llama_cpp` use it (enough for oracle_logits.py)
#
# Environment: LLAMA_CPP_PYTHON_VERSION (default below), MIXQRT_LLAMA_DIR, JOBS (default 2).
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
DIR="${MIXQRT_LLAMA_DIR:-$HOME/.cache/mixqrt-llama}"
JOBS="${JOBS:-2}"
PY="${PYTHON:-python}"
DO_PY=1
DO_TOOLS=1
DO_LIB=0
case "${1:-}" in
  --python-only) DO_TOOLS=0 ;;
  --tools-only) DO_PY=0 ;;
  --lib-only) DO_PY=0; DO_TOOLS=0; DO_LIB=1 ;;
  "") ;;
  -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
  *) echo "unknown option: $1 (see --help)" >&2; exit 2 ;;
esac

mkdir -p "$DIR"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"

# The build backend is needed to read the sdist's metadata and to build it without isolation.
"$PY" -c "import scikit_build_core" 2>/dev/null || "$PY" -m pip install "scikit-build-core>=0.10"
command -v cmake >/dev/null || "$PY" -m pip install cmake

if [ ! -f "$SDIST" ]; then
  # --no-binary only for llama-cpp-python: with ':all:' pip would also compile cmake itself from
  # source for the isolated build environment (tens of minutes) just to read the metadata.
  "$PY" -m pip download --no-deps --no-binary llama-cpp-python --no-build-isolation \
      -d "$DIR" "llama-cpp-python==$VERSION"
fi

# Instruction set: a portable AVX-512 build where the CPU has AMX, because the AMX path that
# GGML_NATIVE turns on there crashes (segfault) in this llama.cpp; otherwise the native build.
if grep -qw amx_tile /proc/cpuinfo 2>/dev/null; then
  FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON"
else
  FLAGS=""
fi
echo "llama-cpp-python $VERSION, cmake flags: ${FLAGS:-(native)}, $JOBS jobs, into $DIR"

if [ "$DO_PY" = 1 ]; then
  start=$(date +%s)
  CMAKE_ARGS="$FLAGS" CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" \
      "$PY" -m pip install --no-build-isolation "$SDIST"
  echo "python bindings: $(( $(date +%s) - start )) s"
fi

SRC="$DIR/src/llama_cpp_python-$VERSION"
if [ "$DO_TOOLS" = 1 ] || [ "$DO_LIB" = 1 ]; then
  if [ ! -d "$SRC" ]; then
    mkdir -p "$DIR/src"
    tar -xzf "$SDIST" -C "$DIR/src"
  fi
fi

if [ "$DO_LIB" = 1 ]; then
  start=$(date +%s)
  # ggml's own sources clash in a unity build; llama's model files are unity-built by llama.cpp itself
  echo 'set(CMAKE_UNITY_BUILD OFF)' > "$DIR/ggml-no-unity.cmake"
  # shellcheck disable=SC2086
  cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build-lib" -DCMAKE_BUILD_TYPE=None -DCMAKE_C_FLAGS=-O1 \
      -DCMAKE_CXX_FLAGS=-O1 -DBUILD_SHARED_LIBS=ON $FLAGS -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
      -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_COMMON=OFF -DLLAMA_OPENSSL=OFF \
      -DCMAKE_UNITY_BUILD=ON -DCMAKE_PROJECT_ggml_INCLUDE="$DIR/ggml-no-unity.cmake"
  cmake --build "$DIR/build-lib" -j "$JOBS" --target llama
  echo "libllama: $(( $(date +%s) - start )) s"
  echo "export LLAMA_CPP_LIB_PATH=$DIR/build-lib/bin PYTHONPATH=$SRC"
fi

if [ "$DO_TOOLS" = 1 ]; then
  start=$(date +%s)
  # No web UI (it would need npm or a download), no curl/openssl: the tools only read local files.
  # shellcheck disable=SC2086
  # Shared libraries: the tools and the Python bindings (LLAMA_CPP_LIB_PATH) use one libllama.
  # No unity build: llama.cpp's mtmd (which the server links) refuses one.
  cmake -S "$SRC/vendor/llama.cpp" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release $FLAGS -DBUILD_SHARED_LIBS=ON \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
      -DLLAMA_BUILD_COMMON=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF \
      -DLLAMA_CURL=OFF -DCMAKE_UNITY_BUILD=OFF
  cmake --build "$DIR/build" --config Release -j "$JOBS" \
      --target llama-server llama-quantize llama-perplexity llama-bench
  echo "tools: $(( $(date +%s) - start )) s"
  ls -l "$DIR/build/bin"
  echo "export MIXQRT_LLAMA_CPP_BIN=$DIR/build/bin"
  echo "export LLAMA_CPP_LIB_PATH=$DIR/build/bin PYTHONPATH=$SRC    # import llama_cpp without pip (pip install diskcache)"
fi
