"""Point-to-point messages over shared memory, pipeline schedules (without
processes), and the pipeline runner against single-process training."""
import functools

import pytest
from torch import nn

import pipeline_cases
from harness import RankPool
from pycomm.pipeline import (Action, bubble_theory, gpipe, one_f_one_b, partition, simulate, stage_layers,
                             validate)

# ------------------------------------------------ schedules (no processes)


@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_schedules_are_valid_and_reach_the_theoretical_bubble(schedule, p, m):
    for s in range(p):
        validate(schedule(p, m, s), m, s)
    sim = simulate(schedule, p, m, forward_time=1.0, backward_time=2.0)
    # Equal stages: the step takes (m + p - 1) (F + B); every stage is busy m (F + B).
    assert sim.makespan == pytest.approx((m + p - 1) * 3.0)
    assert sim.bubble == pytest.approx(bubble_theory(p, m))


@pytest.mark.parametrize("p,m", [(2, 1), (2, 8), (4, 2), (4, 4), (4, 16), (8, 3)])
def test_1f1b_holds_at_most_p_minus_stage_microbatches(p, m):
    g, o = simulate(gpipe, p, m), simulate(one_f_one_b, p, m)
    assert g.peak_in_flight == [m] * p
    assert o.peak_in_flight == [min(p - s, m) for s in range(p)]


def test_schedule_shapes():
    A = Action
    assert gpipe(2, 3, 0) == [A("F", 0), A("F", 1), A("F", 2), A("B", 0), A("B", 1), A("B", 2)]
    assert one_f_one_b(2, 3, 0) == [A("F", 0), A("F", 1), A("B", 0), A("F", 2), A("B", 1), A("B", 2)]
    assert one_f_one_b(2, 3, 1) == [A("F", 0), A("B", 0), A("F", 1), A("B", 1), A("F", 2), A("B", 2)]
    assert one_f_one_b(4, 2, 0) == [A("F", 0), A("F", 1), A("B", 0), A("B", 1)]  # fewer micro-batches than stages


def test_bad_schedules_are_caught():
    with pytest.raises(ValueError, match="before its forward"):
        validate([Action("B", 0), Action("F", 0)], 1, 0)
    with pytest.raises(ValueError, match="expected 4"):
        validate([Action("F", 0), Action("B", 0)], 2, 0)
    with pytest.raises(ValueError, match="out of micro-batch order"):
        validate([Action("F", 1), Action("F", 0), Action("B", 0), Action("B", 1)], 2, 0)

    def backwards_first_on_last_stage(p, m, s):
        # The last stage waits for a forward the first stage runs only after its backwards.
        return gpipe(p, m, s) if s else [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]

    with pytest.raises(ValueError, match="deadlocks"):
        simulate(backwards_first_on_last_stage, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(2, 0, 0)


def test_partition_and_stage_layers():
    assert partition([4, 1, 1, 4], 2) == [2, 2]
    assert partition([1, 1, 1, 10], 2) == [3, 1]
    assert partition([5, 5, 5], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="cannot cut"):
        partition([1, 2], 3)
    built = []

    def factory(i):
        built.append(i)
        return nn.Linear(8, 8)

    layers = [functools.partial(factory, i) for i in range(6)]
    stage = stage_layers(layers, 1, 3)
    # Balanced by parameter count; only this stage's layers were constructed
    # (the others only on the meta device to count them).
    assert len(stage) == 2 and built[-2:] == [2, 3]
    assert sum(1 for i in built if i in (0, 1, 4, 5)) == 4  # once each, for counting
    with pytest.raises(ValueError, match="balance"):
        stage_layers([nn.Linear(2, 2)] * 3, 0, 2, balance=[1, 1])


# -------------------------------------------------------- multi-process


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    assert pool.run(pipeline_cases.init_default, 4, pool.new_name("pipe")) == ["gloo"] * 4
    yield pool
    pool.close()


@pytest.mark.parametrize("world", [2, 4])
def test_p2p_every_dtype_shape_and_pair(pool, world):
    res = pool.run(pipeline_cases.p2p_matrix, world, pool.new_name("p2p"), world, world=world)
    per_peer = len(pipeline_cases.DTYPES) * 5 + 3
    assert [r["checked"] for r in res] == [per_peer * (world - 1)] * world


def test_p2p_both_directions_at_once_larger_than_the_ring(pool):
    assert pool.run(pipeline_cases.p2p_crossing_large, pool.new_name("p2px"), world=2) == [True, True]


def test_p2p_errors_reach_both_ranks(pool):
    r0, r1 = pool.run(pipeline_cases.p2p_errors, pool.new_name("p2pe"), world=2)
    for r in (r0, r1):
        assert "is this rank itself" in r["self"]
        assert "src=5 is not a rank" in r["range"]
        assert "tag must be an int" in r["tag"]
    assert "must be a dense tensor" in r0["bad_send"]
    assert "the sender failed" in r1["bad_send"] and "dense" in r1["bad_send"], r1
    assert r1["bad_send_s"] < 5
    assert "sent tensor 0 as float32[2, 3] but out tensor 0 is float32[3, 2]" in r1["mismatch"], r1
    # Rank 1 failed the channel: rank 0, waiting for a reply, learns why at once.
    assert "float32[2, 3]" in r0["mismatch"] and r0["mismatch_s"] < 10, r0


@pytest.mark.parametrize("num_stages", [1, 2, 4])
def test_pipeline_matches_single_process(pool, num_stages):
    res = pool.run(pipeline_cases.pipeline_matches, num_stages, pool.new_name("pipem"))
    cases = 0
    for rank in range(num_stages):
        for case in res[rank]:
            assert case["has_grads"], (rank, case)
            assert case["grad_rel_err"] < 1e-10, (rank, case)
            if rank == num_stages - 1:
                assert case["loss_err"] < 1e-12, case
            else:
                assert case["loss_err"] is None
            cases += 1
    assert cases == num_stages * 16


def test_pp_dp_2x2_matches_single_process_training(pool):
    res = pool.run(pipeline_cases.pp_dp_matches, 3)
    for r in res:
        assert r["moved"] > 1e-3, r  # training changed the parameters...
        assert r["param_err"] < 1e-10, r  # ...exactly as on one process
    for r in res:
        if r["stage"] == 1:
            for got, ref in r["losses"]:
                assert got is not None
    # Replicas see different halves; their losses average to the full batch's.
    last = [r["losses"] for r in res if r["stage"] == 1]
    for (a, ref), (b, _) in zip(*last):
        assert (a + b) / 2 == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("bad_rank", [1, 2])
def test_a_stage_that_raises_fails_every_rank(pool, bad_rank):
    res = pool.run(pipeline_cases.stage_raises, bad_rank, timeout=60)
    for rank, r in enumerate(res):
        assert r["error"] is not None, (rank, r)
        assert r["seconds"] < 20, (rank, r)  # far below the 60 s timeout
        if rank == bad_rank:
            assert r["error"].startswith("ValueError: boom"), r
        else:
            assert "CommError" in r["error"], r
            assert f"stage {bad_rank % 2} of 2 (rank {bad_rank}) raised ValueError: boom" in r["error"], r
