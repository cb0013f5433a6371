"""Registered (symmetric) memory: comm.empty / comm.register and the in-place
collectives on it.

The matrix runs every collective, algorithm, dtype, op and odd count on
registered tensors (in place, out of place, and mixed with ordinary ones) on
1-8 ranks and requires bitwise equality with the unregistered call, the same
bits on every rank, and the in-place path exactly where it applies. Then:
large multi-block calls, ranks whose buffers differ, errors, segment mode,
and kill -9 with registered buffers (no hang, no leak).
"""
import os

import pytest

import registered_cases as rg
import reliability_cases as rc
from collective_cases import matrix_failures

LONG = os.environ.get("PYCOMM_LONG") == "1"


# CI: the smallest worlds, an odd one and the largest; every world under PYCOMM_LONG=1.
@pytest.mark.parametrize("world", list(range(1, 9)) if LONG else [1, 2, 3, 8])
def test_registered_matrix_bitwise_equal_to_unregistered(pool8, world):
    per_rank = pool8.run(rg.sweep, world, pool8.new_name("reg"), list(rg.COLLECTIVES), world=world)
    failures = matrix_failures(per_rank)
    assert not failures, f"{len(failures)} failing cases of {len(per_rank[0])}:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("world", [2, 3, 5])
def test_registered_all_reduce_across_blocks(pool8, world):
    problems = pool8.run(rg.large, world, pool8.new_name("reglarge"), world=world)
    assert not any(problems), problems


def test_buffers_registered_on_some_ranks_only_run_staged(pool8):
    out = pool8.run(rg.mixed_ranks, 4, pool8.new_name("regmixed"), world=4)
    assert all(o["equal"] for o in out), out
    assert all(o["in_place"] == 0 for o in out), out


def test_registered_errors_and_lifetime(pool8):
    world = 3
    out = pool8.run(rg.errors, world, pool8.new_name("regerr"), world=world)
    for r, o in enumerate(out):
        assert o["foreign"].startswith("CommError") and "another communicator" in o["foreign"], (r, o)
        assert o["resize"] != "no error" and "not resizable" in o["resize"], (r, o)
        assert o["sizes"].startswith("CommError") and "different sizes" in o["sizes"], (r, o)
        assert o["after"] == "True", (r, o)
        assert o["registered"] == "True False False", (r, o)
        assert o["register"] == "True True True", (r, o)
        assert o["after close"] == "6.0", (r, o)


def test_registered_segments_are_private_and_unlinked(pool8):
    before = rc.shm_entries()
    out = pool8.run(rg.segment_mode, 2, pool8.new_name("regmode"), world=2)
    for modes in out:
        assert modes and all(m == "0o600" for m in modes), out
    assert rc.shm_entries() - before == set()


def test_kill_9_with_registered_buffers(pool8):
    zygote = rc.Zygote()
    try:
        trials = 12 if LONG else 4
        for i in range(trials):
            world = (2, 3, 4)[i % 3]
            res = zygote.run(rg.kill_trial, world, 500 + i, timeout=120)
            where = f"trial {i} (world {world}, rank {res['victim']} killed)"
            assert res["hung"] == 0, where
            assert res["leaked"] == [], f"{where}: left {res['leaked']}"
            for r, err in res["errors"].items():
                assert err and err.startswith("CommError"), f"{where}: rank {r}: {err}"
    finally:
        zygote.close()


@pytest.mark.parametrize("world", [2, 3])
def test_coalesced_calls_use_registered_scratch(pool8, world):
    problems = pool8.run(rg.coalesced, world, pool8.new_name("regco"), world=world)
    assert not any(problems), problems


def test_registered_tensors_on_simulated_hosts(pool8):
    problems = pool8.run(rg.on_hosts, 4, pool8.new_name("reghosts"), 2, world=4)
    assert not any(problems), problems
