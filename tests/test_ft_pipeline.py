"""Pipeline x data parallelism that survives failures
(pycomm.elastic.FaultTolerantPipeline): 2 replicas of a 2-rank pipeline, 4
ranks forked from a zygote. A rank is killed -9 (or frozen) at a random
step and moment, under every schedule of the runner and on two simulated
hosts: the other replica finishes every step, the broken replica's survivor
rejoins and forms a new replica with a replacement process, healed stage by
stage; every step, each stage's parameters and optimizer state are
bitwise identical on every replica, and the final loss is the loss of the
same training without a failure."""
import copy

import pytest
import torch

import ft_pipeline_cases as fp
import reliability_cases as rc
import pycomm
from pycomm import elastic
from pycomm.pipeline import SCHEDULES

STEPS = 24


@pytest.fixture(scope="module")
def zygote():
    z = rc.Zygote()
    z.run(fp.preload)
    yield z
    z.close()


@pytest.fixture(scope="module")
def baseline(zygote):
    """The final loss of the same training without a failure, per schedule."""
    cache = {}

    def get(schedule):
        if schedule not in cache:
            res = zygote.run(fp.train, schedule, steps=STEPS, failure=None, timeout=120)
            assert res["split"] == [] and res["hung"] == 0 and set(res["ends"].values()) == {"done"}, res
            cache[schedule] = res["final_loss"]
        return cache[schedule]
    return get


def _check_survived(res, baseline_loss, victim_end="killed"):
    ends = res["ends"]
    assert res["hung"] == 0, res
    assert ends.pop(res["victim"]) == victim_end, res
    # The other replica, the broken replica's survivor (rejoined) and the replacement all finish.
    assert set(ends) == {0, 1, 2, 3, 4} - {res["victim"]} and set(ends.values()) == {"done"}, (res["ends"], res["why"])
    assert res["split"] == [], f"replicas of a stage differ at (step, stage) {res['split'][:5]}"
    assert res["steps_seen"] == STEPS
    done = res["done"]
    assert all(d["replicas"] == 2 for d in done.values()), done  # the replacement replica was admitted
    assert sorted(d["rank"] for d in done.values()) == [0, 1, 2, 3]
    kinds = sorted(e["kind"] for d in done.values() for e in d["events"])
    assert kinds.count("rejoin") == 1 and "shrink" in kinds and "admit" in kinds, kinds
    assert abs(res["final_loss"] - baseline_loss) <= 1e-3 * abs(baseline_loss), (res["final_loss"], baseline_loss)


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_kill_9_under_every_schedule(zygote, baseline, schedule):
    res = zygote.run(fp.train, schedule, steps=STEPS, failure="kill", seed=11, timeout=180)
    _check_survived(res, baseline(schedule))


@pytest.mark.parametrize("victim", [1, 2])
def test_kill_9_on_two_simulated_hosts(zygote, baseline, victim):
    """Replica r on host r: the pipelines within a host, each stage's
    data-parallel group across hosts (a process group between them)."""
    res = zygote.run(fp.train, "1f1b", steps=STEPS, failure="kill", victim=victim, seed=victim, local_size=2,
                     timeout=180)
    _check_survived(res, baseline("1f1b"))
    assert res["recovery"] < 5, res["recovery"]


def test_frozen_rank_is_left_out_and_the_rest_goes_on(zygote, baseline):
    """SIGSTOP: its peers find it by the heartbeat (1 s); continued 4 s after,
    it is fenced out, rejoins, and waits for a partner that never comes (the
    driver ends it once the others are done)."""
    res = zygote.run(fp.train, "1f1b", steps=STEPS, failure="freeze", victim=3, seed=5, timeout=180)
    _check_survived(res, baseline("1f1b"), victim_end="late-joiner")


def test_min_world_size_holds_the_job_until_its_replicas_are_whole_again(zygote, baseline):
    """min_world_size=4 (both replicas): after the kill, the other replica
    shrinks and then waits at that step boundary for the survivor to rejoin
    with the replacement, instead of training alone (no pacing needed)."""
    res = zygote.run(fp.train, "1f1b", steps=STEPS, failure="kill", seed=11, pace=0.0, min_world=4, timeout=180)
    _check_survived(res, baseline("1f1b"))
    for u in (u for u in range(4) if u // 2 != res["victim"] // 2):
        events = [(e["kind"], e["step"], e["world"]) for e in res["done"][u]["events"]]
        assert [k for k, _, _ in events] == ["shrink", "admit"] and events[0][1] == events[1][1], events
        assert events[0][2] == 2 and events[1][2] == 4, events


def test_a_rank_lost_before_the_sub_bootstraps_is_seen_at_once(zygote):
    """A rank that dies after the job's communicator is built and before it
    builds its pipeline's and data-parallel communicators (a newcomer killed
    right after its admission, in the chaos soak) is seen by the peers that
    wait for it there within the heartbeat, and the live peers waiting for a
    rank that gave its build up hear of it at once: the surviving replica
    stands in seconds, not after the 30 s bootstrap timeout (34-39 s before)."""
    reps = zygote.run(fp.dies_before_its_sub_bootstraps, timeout=150)
    for r, rep in reps.items():
        assert rep and "error" not in rep, (r, rep)
        assert rep["replicas"] == 1 and "shrink" in rep["events"], (r, rep)
        assert rep["seconds"] < 15, (r, rep)


def test_drop_skips_the_failed_step(zygote, baseline):
    res = zygote.run(fp.train, "1f1b", steps=STEPS, failure="kill", victim=0, seed=2, on_failure="drop",
                     timeout=180)
    ends = dict(res["ends"])
    assert res["hung"] == 0 and res["split"] == [] and ends.pop(0) == "killed", res
    assert set(ends.values()) == {"done"}, res["why"]
    # One step's update is missing: close to the baseline, not equal to it.
    assert res["final_loss"] != baseline("1f1b") and abs(res["final_loss"] - baseline("1f1b")) < 0.1


def test_bad_arguments_are_refused_and_a_checkpoint_restores():
    store = torch.distributed.HashStore()
    comm = pycomm.Communicator(store=store, rank=0, world_size=1, name="ftpp-args")
    try:
        with pytest.raises(ValueError, match="cannot form pipelines"):
            elastic.FaultTolerantPipeline(fp._stage, lambda p: torch.optim.SGD(p, lr=0.1), comm, num_stages=2,
                                          num_microbatches=2)
        with pytest.raises(ValueError, match="on_failure"):
            elastic.FaultTolerantPipeline(fp._stage, lambda p: torch.optim.SGD(p, lr=0.1), comm, num_stages=1,
                                          num_microbatches=2, on_failure="skip")
        with pytest.raises(TypeError, match="pycomm.Communicator"):
            elastic.FaultTolerantPipeline(fp._stage, lambda p: torch.optim.SGD(p, lr=0.1), object(), num_stages=1,
                                          num_microbatches=2)
        # One rank, one stage: trains, and restores a checkpoint bitwise.
        ft = elastic.FaultTolerantPipeline(fp._stage, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), comm,
                                           num_stages=1, num_microbatches=2, loss_fn=torch.nn.functional.mse_loss)
        x, y = fp._data(4)
        ft.train(2, lambda step, replica, replicas: (x[step], y[step]))
        ckpt = copy.deepcopy(ft.state_dict())  # as torch.save would: the tensors train on
        saved = fp.digest(ft)
        ft.train(4, lambda step, replica, replicas: (x[step], y[step]))
        assert fp.digest(ft) != saved and ft.steps_done == 4
        ft.load_state_dict(ckpt)
        assert fp.digest(ft) == saved and ft.steps_done == 2
        with pytest.raises(ValueError, match="holds stage 1"):
            ft.load_state_dict(dict(ckpt, stage=1))
    finally:
        comm.close()
