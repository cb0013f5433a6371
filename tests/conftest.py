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
