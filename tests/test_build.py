"""The built extension uses torch's C++ runtime and carries no copy of its own.

A toolchain that links libstdc++'s static archive into the extension (the GPU
machine's image did) leaves two runtimes in one process: the extension's
exported std:: symbols bind to torch's shared copy, the rest stays in its own,
and the two disagree on how their locales number facets. Every number the
extension writes into a std::ostream then crashes the process or comes out
empty, which is every error message that names a rank, a count or a size.
setup.py links the runtime torch loaded; these tests check the result, and
that such messages come out whole.
"""
from __future__ import annotations

import shutil
import subprocess

import pytest
import torch

import pycomm
import pycomm._C as _C

#: libstdc++'s own definitions, which a shared build only references:
#: std::ostream::_M_insert<long> (how every integer is written to a stream)
#: and std::locale::classic().
RUNTIME_SYMBOLS = ("_ZNSo9_M_insertIlEERSoT_", "_ZNSt6locale7classicEv")


def _defined_dynamic_symbols() -> set:
    out = subprocess.run(["nm", "-D", "--defined-only", _C.__file__], capture_output=True, text=True, check=True)
    return {line.split()[-1].split("@")[0] for line in out.stdout.splitlines() if line.strip()}


@pytest.mark.skipif(shutil.which("nm") is None, reason="needs nm (binutils)")
def test_extension_carries_no_copy_of_the_cxx_runtime():
    defined = _defined_dynamic_symbols()
    assert not defined & set(RUNTIME_SYMBOLS), (
        f"{_C.__file__} defines libstdc++'s own symbols {sorted(defined & set(RUNTIME_SYMBOLS))}: the build "
        "linked the static libstdc++ (see setup.py, _loaded_cxx_runtime)")
    needed = subprocess.run(["readelf", "-d", _C.__file__], capture_output=True, text=True).stdout
    assert "libstdc++.so" in needed, needed


def test_numbers_in_the_extension_s_messages_come_out_whole():
    """A message the C++ side formats with numbers in it, in this process:
    a quantized buffer too small for the elements asked of it."""
    n = 4097
    with pytest.raises((RuntimeError, ValueError, pycomm.CommError)) as e:
        torch.ops.pycomm.dequantize(torch.zeros(3, dtype=torch.uint8), n, 8, 256, torch.float32)
    assert str(n) in str(e.value), str(e.value)


def _setup_after(prelude: str) -> subprocess.CompletedProcess:
    """setup.py --version in a fresh interpreter, after ``prelude`` (which
    makes the machine look like another)."""
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = prelude + "; import sys; sys.argv = ['setup.py', '--version']; exec(open('setup.py').read())"
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60)


def test_setup_says_linux_only_elsewhere():
    """On another OS setup.py stops with what pycomm needs, before torch is
    imported or a compiler runs (sys.platform stands in for that OS)."""
    r = _setup_after("import sys; sys.platform = 'darwin'")
    assert r.returncode == 1 and "builds on Linux only" in r.stderr and "darwin" in r.stderr, r.stderr[-500:]
    assert "Traceback" not in r.stderr, r.stderr[-500:]  # a message, not an import failing on the way


def test_setup_says_which_setuptools_it_needs():
    """An older setuptools rejects pyproject.toml's license string with a
    schema error; setup.py says what to install instead (the version stands
    in for an older install)."""
    r = _setup_after("import setuptools; setuptools.__version__ = '70.3.0'")
    assert r.returncode == 1 and "setuptools >= 77" in r.stderr and "70.3.0" in r.stderr, r.stderr[-500:]
    assert "Traceback" not in r.stderr, r.stderr[-500:]


def test_the_source_distribution_carries_what_the_build_reads(tmp_path):
    """The sdist (setuptools' PEP 517 hook, what pip and build call) holds
    every file under csrc/ (headers and .cu files are read only by the
    compiler, so setuptools leaves them out without MANIFEST.in), setup.py,
    the package's modules and the license; no built extension."""
    import pathlib
    import sys
    import tarfile

    root = pathlib.Path(pycomm.__file__).resolve().parent.parent
    if not (root / "setup.py").exists():
        pytest.skip("pycomm is not imported from a source checkout")
    # From a copy without egg-info: setuptools adds whatever an earlier
    # build's SOURCES.txt lists, which would hide a file MANIFEST.in misses.
    src = tmp_path / "src"
    shutil.copytree(root, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "*.so", "__pycache__", "bench-results", "gpu-logs", ".iproute"))
    subprocess.run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
                    "build_meta.build_sdist(sys.argv[1])", str(tmp_path)],
                   cwd=src, check=True, capture_output=True, text=True)
    (archive,) = tmp_path.glob("torch_pycomm-*.tar.gz")
    with tarfile.open(archive) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        pkg_info = tar.extractfile(next(n for n in tar.getnames() if n.count("/") == 1
                                        and n.endswith("/PKG-INFO"))).read().decode()
    wanted = {p.relative_to(root).as_posix() for p in (root / "csrc").rglob("*")
              if p.is_file() and p.suffix in (".h", ".cuh", ".cpp", ".cu", ".md")}
    wanted |= {p.relative_to(root).as_posix() for p in (root / "pycomm").rglob("*.py")}
    wanted |= {"setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"}
    assert not wanted - names, sorted(wanted - names)[:20]
    assert not [n for n in names if n.endswith((".so", ".o"))]
    assert "License-Expression: BSD-3-Clause" in pkg_info

