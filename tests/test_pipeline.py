"""Point-to-point messages over shared memory, pipeline schedules (without
processes), and the pipeline runner against single-process training."""
import functools

import pytest
from torch import nn

import pipeline_cases
from harness import RankPool
from pycomm.pipeline import (Action, bubble_theory, get_schedule, gpipe, interleaved_1f1b, one_f_one_b, partition,
                             plans, simulate, split_weights, stage_layers, stages_of, validate, zb_h1, zbv,
                             zero_bubble_theory)

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
    with pytest.raises(ValueError, match="runs 1 F actions, expected 2"):
        validate([Action("F", 0), Action("B", 0)], 2, 0)
    with pytest.raises(ValueError, match="before its backward"):
        validate([Action("F", 0), Action("W", 0), Action("B", 0)], 1, 0)
    with pytest.raises(ValueError, match="appears twice"):
        validate([Action("F", 0), Action("B", 0), Action("W", 0), Action("W", 0)], 1, 0)
    with pytest.raises(ValueError, match="ranks 0 and 1"):
        simulate(lambda p, m, r: [Action("F", 0, 0), Action("B", 0, 0)], 2, 1)
    with pytest.raises(ValueError, match="stages must be 0..S-1"):
        simulate(lambda p, m, r: [Action("F", 0, 2 * r), Action("B", 0, 2 * r)], 2, 1)

    def backwards_first_on_last_stage(p, m, s):
        # The last stage waits for a forward the first stage runs only after its backwards.
        return gpipe(p, m, s) if s else [Action("F", 0), Action("B", 0), Action("F", 1), Action("B", 1)]

    with pytest.raises(ValueError, match="deadlocks"):
        simulate(backwards_first_on_last_stage, 2, 2)
    with pytest.raises(ValueError, match="num_microbatches"):
        gpipe(2, 0, 0)


V_SCHEDULES = [("interleaved-1f1b", 2), ("interleaved-1f1b", 3), ("interleaved-zb", 2), ("zbv", 2)]


@pytest.mark.parametrize("name,v", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1)] + V_SCHEDULES)
@pytest.mark.parametrize("p", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 16])
def test_every_schedule_is_valid_and_never_deadlocks(name, v, p, m):
    fn = get_schedule(name, None if v == 1 else v)
    all_plans = plans(fn, p, m)
    for r, plan in enumerate(all_plans):
        validate(plan, m, r)
        assert sorted({a.stage for a in plan}) == stages_of(fn, p, r)
        assert len({a.stage for a in plan}) == v
    sim = simulate(fn, p, m)  # raises on a deadlock
    assert sim.makespan >= 3 * m * v - 1e-9  # each rank computes v*m*(F+B)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_1f1b_reaches_its_bubble(p, m_per_p, v):
    m = p * m_per_p
    # A chunk is 1/v of a stage: forward 1/v, backward 2/v.
    sim = simulate(get_schedule("interleaved-1f1b", v), p, m, forward_time=1.0 / v, backward_time=2.0 / v)
    assert sim.bubble == pytest.approx(bubble_theory(p, m, v))
    one = simulate(one_f_one_b, p, m)
    assert sim.idle == pytest.approx(one.idle / v)  # 1/v of 1F1B's idle time
    # Megatron's memory: rank r holds at most 2(p-r-1) + (v-1)p + 1 chunks.
    assert sim.peak_in_flight == [min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1) for r in range(p)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
@pytest.mark.parametrize("m_per_p", [1, 2, 4])
def test_zero_bubble_schedules_reach_their_bubble_at_1f1b_memory(p, m_per_p):
    m = p * m_per_p
    one = simulate(one_f_one_b, p, m, forward_time=1.0, backward_time=2.0)
    zb = simulate(zb_h1, p, m, forward_time=1.0, backward_time=2.0, weight_time=1.0)  # F = B = W
    assert zb.bubble == pytest.approx(zero_bubble_theory(p, m))
    assert zb.idle == pytest.approx(one.idle / 3)
    # Rank r holds p - r micro-batches waiting for B and up to r waiting for W: 1F1B's peak, p.
    assert max(zb.peak_in_flight) == max(one.peak_in_flight) == p
    izb = simulate(get_schedule("interleaved-zb", 2), p, m, forward_time=0.5, backward_time=1.0)
    assert izb.bubble == pytest.approx(zero_bubble_theory(p, m, 2))
    # ZB-V: both chunks of a rank at most 2p half-stage activations, i.e. 1F1B's peak;
    # never worse than ZB-H1.
    v = simulate(zbv, p, m, forward_time=0.5, backward_time=1.0)
    assert max(v.peak_in_flight) <= 2 * p
    assert v.bubble <= zb.bubble + 1e-9


def test_new_schedule_shapes():
    A = Action
    assert interleaved_1f1b(2, 2, 0) == [A("F", 0, 0), A("F", 1, 0), A("F", 0, 2), A("F", 1, 2), A("B", 0, 2),
                                         A("B", 1, 2), A("B", 0, 0), A("B", 1, 0)]
    assert zb_h1(2, 2, 0) == [A("F", 0), A("F", 1), A("B", 0), A("W", 0), A("B", 1), A("W", 1)]
    assert split_weights([A("F", 0), A("B", 0), A("F", 1), A("B", 1)], 1) == [A("F", 0), A("B", 0), A("F", 1),
                                                                              A("B", 1), A("W", 0), A("W", 1)]
    assert stages_of(get_schedule("zbv"), 4, 0) == [0, 7] and stages_of(get_schedule("zbv"), 4, 3) == [3, 4]
    assert stages_of(get_schedule("interleaved-1f1b", 3), 4, 1) == [1, 5, 9]
    assert zbv(1, 1, 0) == [A("F", 0, 0), A("F", 0, 1), A("B", 0, 1), A("B", 0, 0), A("W", 0, 1), A("W", 0, 0)]
    with pytest.raises(ValueError, match="runs 1 stage"):
        get_schedule("1f1b", 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        get_schedule("dualpipe")
    with pytest.raises(ValueError, match="virtual_stages must be"):
        get_schedule("interleaved-1f1b", 0)


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


@pytest.mark.parametrize("world,kwargs", [(2, {"local_size": 1}), (4, {"local_size": 2}), (3, {"transport": "pg"})])
def test_p2p_between_hosts(pool, world, kwargs):
    """The same matrix where peers are on other (simulated) hosts: messages
    travel over the process group with the same protocol."""
    res = pool.run(pipeline_cases.p2p_matrix, world, pool.new_name("p2ph"), world, world=world, **kwargs)
    per_peer = len(pipeline_cases.DTYPES) * 5 + 3
    assert [r["checked"] for r in res] == [per_peer * (world - 1)] * world


@pytest.mark.parametrize("pinned", [True, False])
def test_p2p_when_both_ranks_share_a_cpu(pool, pinned):
    res = pool.run(pipeline_cases.p2p_on_one_cpu, pool.new_name("p2pcpu"), pinned, world=2)
    assert res == [{"wrong": 0, "affinity_kept": True}] * 2


def test_p2p_errors_between_hosts(pool):
    r0, r1 = pool.run(pipeline_cases.p2p_errors, pool.new_name("p2peh"), world=2, local_size=1)
    assert "must be a dense tensor" in r0["bad_send"]
    assert "the sender failed" in r1["bad_send"] and "dense" in r1["bad_send"], r1
    assert "sent tensor 0 as float32[2, 3] but out tensor 0 is float32[3, 2]" in r1["mismatch"], r1


def test_an_abort_ends_its_stream_between_hosts(pool):
    """After an abort's message, later receives and sends raise it at once,
    a receive from a rank that aborted before it sent anything raises too,
    as does one posted after the aborted rank closed, and closes do not wait for sends a failed rank will never take, nor for
    an aborted rank's reason no peer takes (each took the 30 s timeout, and
    the send was queued, before)."""
    r0, r1 = pool.run(pipeline_cases.p2p_abort_between_hosts, pool.new_name("p2pend"), world=2)
    assert r1["data"] == ("ok", 0.0), r1
    for key in ("reason", "after"):
        assert r1[key][0] == "error" and "the sender failed: rank 0's stage raised" in r1[key][1], (key, r1)
        assert r1[key + "_s"] < 10, (key, r1)
    for key in ("first", "second"):  # rank 1's reason, or rank 0's own abort
        assert r0[key][0] == "error" and ("rank 1 stopped" in r0[key][1] or "rank 0's stage" in r0[key][1]), r0
        assert r0[key + "_s"] < 10, (key, r0)
    assert r0["reply"][0] == "error" and "rank 1 took one" in r0["reply"][1], r0
    assert r1["reason_e"][0] == "error" and "the sender failed: rank 0 quit" in r1["reason_e"][1], r1
    assert r1["send_e"][0] == "error" and "rank 0 failed and receives nothing more: rank 0 quit" in r1["send_e"][1], r1
    assert r1["send_e_s"] < 10, r1
    assert r1["first_f"][0] == "error" and "the sender failed: rank 0 failed before it sent" in r1["first_f"][1], r1
    assert r1["first_f_s"] < 10, r1
    assert r0["close_g_s"] < 1.5, r0  # not the 2 s an aborted rank's sends may wait
    for key in ("late_g", "again_g"):  # its reason, or its closed connection explained by the failure board
        assert r1[key][0] == "error" and "rank 0 quit before any message" in r1[key][1], (key, r1)
        assert r1[key + "_s"] < 10, (key, r1)
    for r in (r0, r1):
        for key in ("close_a", "close_b", "close_c", "close_d", "close_e", "close_f", "close_g"):
            assert r[key][0] == "ok" and r[key + "_s"] < 10, (key, r)


def test_pipeline_on_two_hosts_matches_single_process(pool):
    """2 hosts x 2 ranks (simulated): every schedule; the stages of one host
    talk over shared memory, the hop between hosts over the process group."""
    res = pool.run(pipeline_cases.pipeline_matches, 4, pool.new_name("pipeh"), local_size=2)
    cases = 0
    for rank in range(4):
        for case in res[rank]:
            assert case["has_grads"] and case["grad_rel_err"] < 1e-10, (rank, case)
            if case["last"]:
                assert case["loss_err"] < 1e-12, case
            cases += 1
    assert cases == 4 * len(pipeline_cases.SCHEDULES) * 5 * 2


def test_a_sender_killed_before_its_receiver_attached_leaves_no_segment():
    """kill -9 of a rank whose message waits, unread, in a channel it created:
    the receiver's close removes the channel's name (a pool of its own, as
    the killed worker does not come back)."""
    pool = RankPool(2)
    try:
        out = pool.run_expect(pipeline_cases.p2p_sender_killed_before_the_receiver_attached, pool.new_name("p2pk"),
                              world=2, timeout=60)
    finally:
        pool.close()
    assert out[1] == ("dead", None), out[1]
    status, r0 = out[0]
    assert status == "ok", r0
    assert r0["peer_gone"] and len(r0["channel"]) == 1 and r0["channel"][0].endswith(".p2p.1.0"), r0
    assert r0["left"] == [], r0


def test_p2p_both_directions_at_once_larger_than_the_ring(pool):
    assert pool.run(pipeline_cases.p2p_crossing_large, pool.new_name("p2px"), world=2) == [True, True]


def test_p2p_errors_reach_both_ranks(pool):
    r0, r1 = pool.run(pipeline_cases.p2p_errors, pool.new_name("p2pe"), world=2)
    assert "lazy conjugate view" in r0["conj_send"] and "resolve_conj()" in r0["conj_send"], r0
    assert "the sender failed" in r1["conj_send"] and "lazy conjugate view" in r1["conj_send"], r1
    assert "lazy conjugate view" in r1["conj_out"], r1
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
    """Every schedule, with one and two stages per rank, against one process (float64)."""
    res = pool.run(pipeline_cases.pipeline_matches, num_stages, pool.new_name("pipem"))
    cases, params = 0, 0
    for rank in range(num_stages):
        for case in res[rank]:
            assert case["has_grads"], (rank, case)
            assert case["grad_rel_err"] < 1e-10, (rank, case)
            if case["last"]:
                assert case["loss_err"] < 1e-12, case
            else:
                assert case["loss_err"] is None
            cases += 1
            params += case["compared"]
    per_rank = len(pipeline_cases.SCHEDULES) * 5 * 2
    assert cases == num_stages * per_rank
    # Every parameter of the model was compared, once per case.
    assert params == per_rank * 14


@pytest.mark.parametrize("schedule,checkpoint", [("1f1b", False), ("zb-h1", True), ("zbv", False)])
def test_loss_scaling_skips_the_same_steps_on_every_stage(pool, schedule, checkpoint):
    """Mixed precision in a pipeline (grad_scaler=): the last stage's backward
    starts from the scaled loss, so every stage's gradients carry one scale.
    With ShardedGradScaler over the pipeline's ranks, an overflow in stage 0
    alone skips the step on both stages and halves both scales; every other
    step equals the unscaled pipeline's bit for bit (a power-of-two scale),
    and step() returns the loss unscaled. Split backwards (zero bubble) and
    recomputation scale their loss too."""
    res = pool.run(pipeline_cases.loss_scaling, pool.new_name("amp"), "sharded", schedule, checkpoint)[:2]
    for r in res:
        assert r["moved"] == [True, True, False, True, True, True], r
        assert r["scales"][2] == r["scales"][1] / 2, r
        assert r["same_params"] and r["same_losses"], r
    assert res[0]["scales"] == res[1]["scales"]


def test_a_plain_grad_scaler_is_refused(pool):
    """torch's GradScaler decides overflows per rank: stages would skip
    different steps (and unscale by scales the loss was not multiplied by)."""
    for r in pool.run(pipeline_cases.loss_scaling, pool.new_name("amp"), "plain")[:2]:
        assert "decides overflows per rank" in r["refused"] and "ShardedGradScaler" in r["refused"], r


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-zb", 2), ("zbv", 2)])
def test_pp_dp_2x2_matches_single_process_training(pool, schedule, v):
    res = pool.run(pipeline_cases.pp_dp_matches, 3, schedule, v)
    for r in res:
        assert r["moved"] > 1e-3, r  # training changed the parameters...
        assert r["param_err"] < 1e-10, r  # ...exactly as on one process
    for r in res:
        if r["last"]:
            for got, ref in r["losses"]:
                assert got is not None
    # Replicas see different halves; their losses average to the full batch's.
    last = [r["losses"] for r in res if r["last"]]
    assert len(last) == 2
    for (a, ref), (b, _) in zip(*last):
        assert (a + b) / 2 == pytest.approx(ref, rel=1e-9)


@pytest.mark.parametrize("hosts", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "interleaved-zb", "zbv"])
@pytest.mark.parametrize("bad_rank", [1, 2])
def test_a_stage_that_raises_fails_every_rank(pool, bad_rank, schedule, hosts):
    """On one host, and with every rank on its own (simulated) host, where the
    reason travels as the raising rank's last message to each peer."""
    res = pool.run(pipeline_cases.stage_raises, bad_rank, schedule, hosts, timeout=60)
    for rank, r in enumerate(res):
        assert r["error"] is not None, (rank, r)
        assert r["seconds"] < 20, (rank, r)  # far below the 60 s timeout
        if rank == bad_rank:
            assert r["error"].startswith("ValueError: boom"), r
        else:
            assert "CommError" in r["error"], r
            stages, first = r["num_stages"], bad_rank if hosts else bad_rank % 2
            assert f"stage {first} of {stages} (rank {bad_rank}) raised ValueError: boom" in r["error"], r
