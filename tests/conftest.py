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


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
