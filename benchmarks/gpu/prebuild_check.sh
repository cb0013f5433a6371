#!/usr/bin/env bash
# Before a GPU lease: builds the CUDA extension here, without a GPU, against
# the torch the GPU machine has (its C++17, its headers, its libraries), and
# checks that every symbol the library needs is exported by that torch, the
# CUDA runtime or the C/C++ runtimes. A build or import failure found here
# costs nothing; found there, it costs a call of the lease.
#   bash benchmarks/gpu/prebuild_check.sh [TORCH_VERSION]   # default 2.11.0
# Downloads that torch's wheel (~0.5 GB, no dependencies) into
# build/prebuild-<version>/ once; compiles at -O0 (a check, not a build to run).
set -euo pipefail
cd "$(dirname "$0")/../.."
VERSION=${1:-2.11.0}
DIR=build/prebuild-$VERSION
mkdir -p "$DIR/obj"
PY=${PYTHON:-python3}
if [ ! -d "$DIR/torch/lib" ]; then
  "$PY" -m pip download -q --no-deps --only-binary=:all: "torch==$VERSION" -d "$DIR"
  (cd "$DIR" && unzip -q -o torch-"$VERSION"-*.whl 'torch/include/*' 'torch/lib/*.so')
fi
T=$DIR/torch/include
L=$DIR/torch/lib
PYI=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
# nvcc may be a wrapper script: ask it where its toolkit lies.
CUDA=${CUDA_HOME:-$(nvcc -v -E -x cu /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)}
[ -f "$CUDA/include/cuda_runtime.h" ] || CUDA=/usr/local/cuda
OBJ=$DIR/obj
rm -f "$OBJ"/*.o
export T PYI CUDA OBJ
# The flags setup.py gives a CUDAExtension (PYCOMM_WITH_CUDA, C++17), at -O0.
find csrc -name "*.cpp" | xargs -P "$(nproc)" -I{} sh -c 'o=$OBJ/$(echo {} | tr / _).o; g++ -std=c++17 -O0 -g0 -fPIC \
  -fvisibility=hidden -ffp-contract=off -DPYCOMM_WITH_CUDA=1 -DTORCH_EXTENSION_NAME=_C -DTORCH_API_INCLUDE_EXTENSION_H \
  -I$T -I$T/torch/csrc/api/include -I$PYI -I$CUDA/include -c {} -o $o || { echo "FAILED: {}"; exit 255; }'
find csrc -name "*.cu" | xargs -P "$(nproc)" -I{} sh -c 'o=$OBJ/$(echo {} | tr / _).o; nvcc -std=c++17 -O0 \
  -Xcompiler -fPIC --expt-relaxed-constexpr --fmad=false -gencode arch=compute_90,code=sm_90 -DPYCOMM_WITH_CUDA=1 \
  -c {} -o $o || { echo "FAILED: {}"; exit 255; }'
g++ -shared -o "$DIR/_C.so" "$OBJ"/*.o -L"$L" -lc10 -ltorch -ltorch_cpu -ltorch_python -lc10_cuda -ltorch_cuda \
  -L"$CUDA/lib64" -lcudart
# Every undefined symbol must be defined by one of the libraries it will
# meet at import (Python's own come from the interpreter).
nm -D --undefined-only "$DIR/_C.so" | awk '{print $2}' | sed 's/@.*//' | sort -u > "$DIR/needed.txt"
for lib in "$L"/libc10.so "$L"/libtorch.so "$L"/libtorch_cpu.so "$L"/libtorch_python.so "$L"/libc10_cuda.so \
  "$L"/libtorch_cuda.so "$CUDA"/lib64/libcudart.so $(ldconfig -p | awk '/(libstdc\+\+\.so\.6|libc\.so\.6|libm\.so\.6|libgcc_s\.so\.1) .*x86-64/{print $NF}'); do
  nm -D --defined-only "$lib" | awk '{print $3}' | sed 's/@.*//'
done | sort -u > "$DIR/exported.txt"
missing=$(comm -23 "$DIR/needed.txt" "$DIR/exported.txt" | grep -Ev '^(_?Py|_ITM_|__gmon_start__|__tls_get_addr)' || true)
if [ -n "$missing" ]; then
  echo "symbols torch $VERSION does not export:"; echo "$missing"; exit 1
fi
echo "pycomm's CUDA build compiles and links against torch $VERSION: $(wc -l < "$DIR/needed.txt") symbols needed, all found"
