"""Cached or streaming mailbox stores (csrc/transport/store_tuner.h): every
collective and algorithm gives the same bits in either mode and under the
tuner, on 2 and 3 ranks; a wrong setting is refused with a clear message.
The tuner's decisions are tested in tests/cpp/store_tuner.cpp."""
import pytest

import store_cases as sc
from harness import RankPool


@pytest.fixture(scope="module")
def pool3():
    pool = RankPool(3)
    yield pool
    pool.close()


@pytest.mark.parametrize("world", [2, 3])
def test_store_modes_change_no_bit(pool3, world):
    per_rank = pool3.run(sc.modes_agree, world, pool3.new_name("stores"), world=world)
    for r, cases in enumerate(per_rank):
        for key, by_policy in cases.items():
            assert len(set(by_policy.values())) == 1, (r, key, by_policy)
    # Replicated results agree across ranks too.
    for key in per_rank[0]:
        if key.startswith(("all_reduce", "all_gather")):
            assert len({cases[key]["auto"] for cases in per_rank}) == 1, key


def test_tuner_samples_streaming_without_changing_results(pool3):
    bad = pool3.run(sc.auto_over_many_calls, 2, pool3.new_name("auto"), 140, world=2)
    assert bad == [[], []], bad


def test_unknown_store_policy_is_refused(pool3):
    out = pool3.run(sc.bad_policy, 2, pool3.new_name("badstores"), world=2)
    for msg in out:
        assert msg.startswith("CommError") and "PYCOMM_SHM_STORES must be auto, cached or streaming" in msg, out
