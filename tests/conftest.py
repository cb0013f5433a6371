import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from harness import RankPool  # noqa: E402


@pytest.fixture(scope="module")
def pool8():
    """Eight worker ranks, started once for the whole test module."""
    pool = RankPool(8)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def torch_free_objects(tmp_path_factory):
    """Every .cpp of the torch-free layers compiled once, side by side, for the
    two checks that need them (test_layers: each compiles alone, warning-free,
    without torch on the include path; test_compression_kernels: they link
    with the CUDA files): -O0 -fPIC -Wall -Wextra -Werror, no include path.
    {source path: (returncode, stderr, object path)}."""
    import shutil
    from pathlib import Path

    from harness import compile_all

    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    csrc = Path(__file__).resolve().parent.parent / "csrc"
    srcs = [p for layer in ("core", "kernels", "algorithms", "transport", "compression")
            for p in sorted((csrc / layer).rglob("*.cpp"))]
    out = tmp_path_factory.mktemp("torch-free-objects")
    objs = [str(out / f"{i}.o") for i in range(len(srcs))]
    results = compile_all([["g++", "-std=c++17", "-c", "-O0", "-fPIC", "-Wall", "-Wextra", "-Werror", str(src), "-o",
                            obj] for src, obj in zip(srcs, objs)])
    return {src: (rc, err, obj) for src, obj, (rc, err) in zip(srcs, objs, results)}


@pytest.fixture(scope="session")
def digits_baseline():
    """Accuracy of plain synchronous DDP on hooks_cases' digits recipe, per
    rank: ``digits_baseline(pool, world, steps, lr=...)``. Several modules
    compare against the same training (it takes seconds); it runs once per
    session and setting, in whichever module's pool asks first."""
    import hooks_cases

    cache: dict = {}

    def get(pool, world: int, steps: int, **kwargs):
        key = (world, steps, tuple(sorted(kwargs.items())))
        if key not in cache:
            cache[key] = pool.run(hooks_cases.digits_accuracy, world, None, steps, **kwargs)[:world]
        return cache[key]

    return get


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# A CUDA error such as a misaligned or illegal address is sticky: every later
# CUDA call of the process fails with it, and one faulting kernel failed 49
# unrelated tests after it on a GPU lease. The tests that would run CUDA in
# this process after such an error are skipped instead, naming the culprit;
# with PYCOMM_CUDA_RERUN naming a file, their ids are appended to it, and
# benchmarks/gpu/run.sh runs them again in a fresh process. (Tests whose
# CUDA work runs in rank pools are not touched by this process's context.)
_POOLED = {"gpu_pool", "ddp_pool", "ft_zygote"}
_poisoned_by: list = []


def _cuda_in_this_process(item) -> bool:
    return "cuda" in item.keywords and not _POOLED & set(getattr(item, "fixturenames", ()))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    yield
    if call.excinfo is None or _poisoned_by or not _cuda_in_this_process(item):
        return
    import torch

    sticky = getattr(torch, "AcceleratorError", None)
    if (sticky is not None and call.excinfo.errisinstance(sticky)) or "CUDA error" in str(call.excinfo.value):
        _poisoned_by.append(item.nodeid)


def pytest_runtest_setup(item):
    if not _poisoned_by or not _cuda_in_this_process(item):
        return
    rerun = os.environ.get("PYCOMM_CUDA_RERUN")
    if rerun:
        with open(rerun, "a") as f:
            f.write(item.nodeid + "\n")
    pytest.skip(f"this process's CUDA context is poisoned (sticky error in {_poisoned_by[0]}); "
                "run it again in a fresh process")
