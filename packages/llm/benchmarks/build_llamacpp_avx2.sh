#!/bin/sh
# Builds llama-cpp-python, the version the bench environment pins, with ggml's CPU code held to AVX2 (x86-64-v3: AVX2,
# FMA, F16C, BMI2; no AVX-512, no AVX-VNNI, no AMX) into /.llamacpp-avx2/ at the repository root (git-ignored), for
# llamacpp_compare.py --avx2 to put first on sys.path. A build that is there already is kept; delete the folder to
# rebuild. GGML_NATIVE=OFF: -march=native would turn every extension of this host on whatever the options say.
# The multimodal library (LLAVA_BUILD) is not built: the comparison does not load it and llama_cpp imports it lazily.
# Usage: build_llamacpp_avx2.sh [PYTHON]  (default: python3; the bench environment's python is the one to pass)
set -eu
PY=${1:-python3}
ROOT=$(cd "$(dirname "$0")/../../.." && pwd)
DEST=$ROOT/.llamacpp-avx2
VERSION=$("$PY" -c "import importlib.metadata as m; print(m.version('llama_cpp_python'))")
if [ -f "$DEST/llama_cpp/__init__.py" ]; then echo "$DEST: already built"; exit 0; fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
export CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_CPU_ALL_VARIANTS=OFF -DGGML_BACKEND_DL=OFF -DLLAVA_BUILD=OFF \
 -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
 -DGGML_AVX_VNNI=OFF -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF \
 -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
nice "$PY" -m pip install --no-deps --no-binary llama-cpp-python --no-cache-dir --target "$DEST.partial" "llama-cpp-python==$VERSION"
# the build's own report of the instructions it uses (it lists those built in): AVX2 and no AVX512, or it is not the
# build wanted; run from / so that no llama_cpp folder in the working directory is imported instead
INFO=$(cd / && PYTHONPATH="$DEST.partial" "$PY" -c "import llama_cpp; print(llama_cpp.llama_print_system_info().decode())")
echo "$INFO"
case "$INFO" in *"AVX2 = 1"*) ;; *) echo "the build has no AVX2" >&2; exit 1;; esac
case "$INFO" in *AVX512*|*AVX_VNNI*|*AMX*) echo "the build uses more than AVX2" >&2; exit 1;; esac
rm -rf "$DEST" && mv "$DEST.partial" "$DEST"
