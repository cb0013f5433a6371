"""C++ tests of the torch-free layers (tests/cpp/*.cpp), built with
ThreadSanitizer against those layers' sources alone: data races between a
communicator's threads (its progress thread, point-to-point lanes and the
caller changing settings) and the blame chain's logic, tested without
processes or torch."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from harness import compile_all

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
TESTS = sorted((ROOT / "tests" / "cpp").glob("*.cpp"))
# PYCOMM_RACE_WINDOWS: a test may widen the hand-overs between threads
# (csrc/core/race_window.h) by setting PYCOMM_RACE_WINDOW_US itself.
FLAGS = ["-std=c++17", "-O1", "-g1", "-fsanitize=thread", "-Wall", "-DPYCOMM_RACE_WINDOWS", f"-I{CSRC}"]



def _tsan_available() -> bool:
    if shutil.which("g++") is None:
        return False
    r = subprocess.run(["g++", "-fsanitize=thread", "-x", "c++", "-", "-o", os.devnull],
                       input="int main() { return 0; }\n", capture_output=True, text=True)
    return r.returncode == 0


pytestmark = pytest.mark.skipif(not _tsan_available(), reason="needs g++ with ThreadSanitizer (libtsan)")


def library_sources():
    """Every .cpp of the layers below csrc/torch (CUDA files excluded)."""
    out = []
    for layer in ("core", "kernels", "algorithms", "transport", "compression"):
        out += [p for p in sorted((CSRC / layer).rglob("*.cpp")) if "cuda" not in p.parts]
    return out


@pytest.fixture(scope="module")
def objects(tmp_path_factory):
    build = tmp_path_factory.mktemp("cpp")
    srcs = library_sources()
    objs = [build / (str(src.relative_to(CSRC)).replace("/", "_") + ".o") for src in srcs]
    results = compile_all([["g++", *FLAGS, "-c", str(src), "-o", str(obj)] for src, obj in zip(srcs, objs)])
    for src, (rc, err) in zip(srcs, results):
        assert rc == 0, f"{src}:\n{err}"
    return build, objs


@pytest.mark.parametrize("test", TESTS, ids=[t.stem for t in TESTS])
def test_cpp(objects, test):
    build, objs = objects
    exe = build / test.stem
    r = subprocess.run(["g++", *FLAGS, str(test), *map(str, objs), "-o", str(exe), "-lpthread"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=1:exitcode=66")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), f"exit {r.returncode}\n{r.stdout}\n{r.stderr}"
