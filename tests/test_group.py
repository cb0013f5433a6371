"""pycomm.GroupCommunicator (the device-generic compressed all-reduce over a
torch.distributed group) against the shared-memory compressed all-reduce:
the same outputs and residuals, bit for bit, over Gloo on CPU (the CUDA twin
of these cases is in test_cuda.py)."""
import pytest
import torch

import group_cases
from harness import RankPool

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def pool5():
    pool = RankPool(5)
    pool.run(group_cases.init, 5, pool.new_name("group"))
    yield pool
    pool.close()


def _cases(world):
    cases = []
    for i, codec in enumerate(c for c in group_cases.CODECS if c != "topk_half_entry"):
        for j, dtype in enumerate(DTYPES):
            n = [1, 1021, 70001, 4099][(i + j + world) % 4]
            cases.append((codec, n, dtype, "avg" if (i + j) % 2 == 0 else "sum"))
    cases.append(("int8", 0, torch.float32, "avg"))
    # Shards over GLOO_GATHER_BY_ALL_TO_ALL bytes (1-4 ranks): gathered by Gloo's
    # all-gather instead of an all-to-all, the same bits.
    cases.append(("int8", 600011, torch.float32, "avg"))
    cases.append(("topk_half_entry", 10, torch.float32, "sum"))
    return cases


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_group_path_equals_the_shared_memory_path_bit_for_bit(pool5, world):
    cases = _cases(world)
    name = pool5.new_name("pair")
    per_rank = pool5.run(group_cases.versus_shm, world, name, cases)
    for r in range(world):
        for case, res in zip(cases, per_rank[r]):
            assert not res["bad"], (r, case, res["bad"])
    for i, case in enumerate(cases):
        assert len({per_rank[r][i]["digest"] for r in range(world)}) == 1, ("ranks disagree", case)


def test_group_path_refuses_bad_calls_and_stays_usable(pool5):
    msgs = pool5.run(group_cases.bad_calls, 2, pool5.new_name("pair"))
    for m in msgs[:2]:
        assert "sums or averages" in m[0]
        assert "compression takes" in m[1] and "torch.float64" in m[1]
        assert "is not a codec" in m[2]
        assert "contiguous" in m[3]
        assert "CUDA graph" in m[4]
        assert abs(m[5] - 1.5) < 0.01
