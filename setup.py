"""Build pycomm._C.

CppExtension by default; CUDAExtension when torch was built with CUDA and
nvcc is on the PATH (or CUDA_HOME). Override with PYCOMM_FORCE_CUDA=1 or
PYCOMM_NO_CUDA=1. This is the only place that choice is made.

PYCOMM_SANITIZE=address,undefined or PYCOMM_SANITIZE=thread builds the whole
extension (torch glue included) with those sanitizers, frame pointers, debug
info and widened race windows (csrc/core/race_window.h). Such a build needs its
runtime preloaded into Python: tests/sanitize.sh builds one beside the normal
build and runs tests with it.

The extension links the C++ runtime torch loaded (see _loaded_cxx_runtime);
PYCOMM_CXX_RUNTIME=toolchain leaves that to the toolchain.
"""
import glob
import os
import shutil
import sys

if not sys.platform.startswith("linux"):
    # Said before torch is imported, rather than by the compiler's first
    # error about a header.
    raise SystemExit(f"torch-pycomm builds on Linux only (its transports use futexes, /dev/shm and /proc); "
                     f"this is {sys.platform}")

import setuptools  # noqa: E402

if int(setuptools.__version__.split(".")[0]) < 77:
    # pyproject.toml states the license as an SPDX string, which older
    # setuptools reject with a schema error that does not say this.
    raise SystemExit(f"torch-pycomm builds with setuptools >= 77 (pip install -U 'setuptools>=77'); this is "
                     f"setuptools {setuptools.__version__}")

from setuptools import find_packages, setup  # noqa: E402
from torch.utils import cpp_extension  # noqa: E402

ROOT = os.path.dirname(os.path.abspath(__file__))


def _want_cuda() -> bool:
    if os.environ.get("PYCOMM_NO_CUDA") == "1":
        return False
    if os.environ.get("PYCOMM_FORCE_CUDA") == "1":
        return True
    import torch

    has_nvcc = shutil.which("nvcc") is not None or bool(cpp_extension.CUDA_HOME)
    return torch.version.cuda is not None and has_nvcc


def _loaded_cxx_runtime() -> list:
    """The C++ runtime this interpreter loaded with torch, as a link input.

    The extension must use the one shared libstdc++ that torch uses. A
    toolchain that finds no libstdc++.so to link (only the static archive;
    so it was on the GPU machine's image) pulls libstdc++'s code into the
    extension instead: the extension's exported std:: symbols then bind at
    load time to torch's copy while the rest stays in its own, and the two
    copies disagree on their locales' facet numbering. Every number written
    to a std::ostream in the extension then crashes (error messages: a rank
    that saw its peer die segfaulted formatting the message) or comes out
    empty. Naming the loaded library satisfies every std:: symbol from it,
    so nothing of the archive is linked, whatever the toolchain's defaults.
    PYCOMM_CXX_RUNTIME=toolchain leaves the choice to the toolchain (should
    torch's runtime be older than the compiler's headers need).
    """
    if os.environ.get("PYCOMM_CXX_RUNTIME") == "toolchain" or not os.path.exists("/proc/self/maps"):
        return []
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if os.path.basename(path).startswith("libstdc++.so") and os.path.exists(path):
                return [path]
    return []


def _sources(pattern: str) -> list:
    return sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True))


# *_cuda.cpp files are torch glue for the CUDA kernels (they include CUDA
# headers): CUDA builds only.
cuda_glue = _sources("csrc/**/*_cuda.cpp")
cpp_sources = [p for p in _sources("csrc/**/*.cpp") if p not in cuda_glue]
cuda_sources = cuda_glue + _sources("csrc/**/*.cu")
# No contraction into fused multiply-adds: the default and AVX2 clones of a
# kernel, and its CUDA twin, must round identically, so that ranks on
# different CPUs (or a GPU) compute the same bits.
#
# -g0 overrides the -g that Python's own build flags carry: DWARF for torch's
# headers is most of a torch-glue file's compile time (about a third of the
# build) and 30+ MB of the library; symbols still name every frame.
#
# The C++ standard is torch's choice (C++17 up to torch 2.11, C++20 after:
# newer headers need it). The code stays C++17: benchmarks/gpu/
# prebuild_check.sh builds it against an older torch's headers.
cxx_flags = ["-O3", "-g0", "-fvisibility=hidden", "-Wall", "-ffp-contract=off"]
link_flags: list = _loaded_cxx_runtime()
macros: list = []

# Sanitizers that may be combined, and the ones that must run alone (TSan
# cannot share a process with ASan).
_SANITIZER_SETS = ({"address", "undefined"}, {"address"}, {"undefined"}, {"thread"})


def _sanitize_flags(setting: str) -> list:
    wanted = {s.strip() for s in setting.split(",") if s.strip()}
    if wanted not in _SANITIZER_SETS:
        raise SystemExit(f"PYCOMM_SANITIZE={setting!r}: use address,undefined or thread "
                         "(address and undefined may also be given alone)")
    # -O1: fast enough to run the failure suites, and stack traces still
    # name every frame; -g1 (line tables only) gives every frame its file and
    # line at about half the compile time of -g. UBSan's vptr check needs RTTI
    # of torch's types, which the torch wheel does not export for every class.
    return [f"-fsanitize={','.join(sorted(wanted))}", "-fno-omit-frame-pointer", "-g1", "-O1",
            "-fno-sanitize=vptr"]


if os.environ.get("PYCOMM_SANITIZE"):
    sanitize = _sanitize_flags(os.environ["PYCOMM_SANITIZE"])
    cxx_flags = [f for f in cxx_flags if f not in ("-O3", "-g0")] + sanitize
    link_flags += [f for f in sanitize if f.startswith("-fsanitize")]
    macros = [("PYCOMM_RACE_WINDOWS", "1")]

if _want_cuda():
    ext = cpp_extension.CUDAExtension(
        "pycomm._C",
        cpp_sources + cuda_sources,
        define_macros=[("PYCOMM_WITH_CUDA", "1")] + macros,
        extra_compile_args={"cxx": cxx_flags, "nvcc": ["-O3", "--expt-relaxed-constexpr", "--fmad=false"]},
        extra_link_args=link_flags,
    )
else:
    ext = cpp_extension.CppExtension("pycomm._C", cpp_sources, define_macros=macros,
                                     extra_compile_args={"cxx": cxx_flags}, extra_link_args=link_flags)

setup(
    packages=find_packages(include=["pycomm", "pycomm.*"]),
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension.with_options(use_ninja=True)},
)
