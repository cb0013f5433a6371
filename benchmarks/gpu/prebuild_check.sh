#!/usr/bin/env bash
# Before a GPU lease: builds the CUDA extension here, without a GPU, against
# the torch the GPU machine has (its C++17, its headers, its libraries), and
# checks that every symbol the library needs is exported by that torch, the
# CUDA runtime or the C/C++ runtimes, and that every torch name the Python
# code spells out exists in that torch (not its keyword arguments: run the
# tests with that torch for those). A build or import failure found here
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
  (cd "$DIR" && unzip -q -o torch-"$VERSION"-*.whl 'torch/include/*' 'torch/lib/*.so' 'torch/*.py' 'torch/*.pyi')
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
# The Python side: every torch name the package, tests and benchmarks spell
# out (torch.x.y, dist.x, from torch.x import y) must appear somewhere in that
# torch's Python tree or its bindings' strings. A heuristic (a name may exist
# and mean something else), but an attribute that torch added later shows.
strings "$L/libtorch_python.so" | grep -oE '^[A-Za-z_][A-Za-z0-9_]*$' | sort -u > "$DIR/bound.txt"
"$PY" - "$DIR" <<'PYEOF'
import ast, os, re, sys
root = sys.argv[1]
alias = {"torch": "torch", "dist": "torch.distributed", "nn": "torch.nn", "F": "torch.nn.functional"}
used = {}
for top in ("pycomm", "tests", "benchmarks"):
    for dp, _, fs in os.walk(top):
        for f in fs:
            if f.endswith(".py"):
                path = os.path.join(dp, f)
                for node in ast.walk(ast.parse(open(path).read())):
                    if isinstance(node, ast.Attribute):
                        parts, n = [], node
                        while isinstance(n, ast.Attribute):
                            parts.append(n.attr)
                            n = n.value
                        if isinstance(n, ast.Name) and n.id in alias:
                            used.setdefault(alias[n.id] + "." + ".".join(reversed(parts)), set()).add(path)
                    elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
                        for a in node.names:
                            used.setdefault(node.module + "." + a.name, set()).add(path)
words = set(open(os.path.join(root, "bound.txt")).read().split())
for dp, _, fs in os.walk(os.path.join(root, "torch")):
    for f in fs:
        if f.endswith((".py", ".pyi")):
            words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", open(os.path.join(dp, f), errors="ignore").read()))
# torch.ops.pycomm.* is pycomm's own.
bad = {u: p for u, p in used.items() if not u.startswith("torch.ops.pycomm")
       and any(w not in words for w in u.split(".")[1:])}
for u, p in sorted(bad.items()):
    print(f"not in this torch: {u} (used in {', '.join(sorted(p)[:3])})")
print(f"torch names used: {len(used)}; unknown to this torch: {len(bad)}")
sys.exit(1 if bad else 0)
PYEOF
