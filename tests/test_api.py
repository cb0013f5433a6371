"""The Python API: Work and torch futures, issue order, list forms,
dist.ReduceOp, world size 1, bootstrap from torch.distributed, PYCOMM_ALGO."""
import json

import pytest

from api_cases import (async_and_futures, coalesced, concurrent_closes, default_group, env_algorithm,
                       last_reference_in_a_callback, regrouped, reinit_on_the_same_port, world_of_one)
from harness import RankPool, run_script

WORLD = 3


@pytest.fixture(scope="module")
def pool():
    p = RankPool(WORLD)
    yield p
    p.close()


def test_async_work_futures_and_order(pool):
    for rank, res in enumerate(pool.run(async_and_futures, WORLD, pool.new_name())):
        failed = {k: v for k, v in res.items() if v is not True and k != "algorithm_name"}
        assert not failed, f"rank {rank}: {failed}"
        assert res["algorithm_name"] == "tree"


def test_world_size_one(pool):
    assert pool.run(world_of_one, pool.new_name(), world=1) == [True]


def test_bootstrap_from_default_group(pool):
    for rank, res in enumerate(pool.run(default_group, WORLD, pool.new_name())):
        assert res.pop("rank") == rank and res.pop("world") == WORLD
        assert all(res.values()), res


def test_unnamed_communicators_agree_after_a_new_default_group(pool):
    assert pool.run(regrouped, WORLD, pool.new_name(), timeout=120) == [True] * WORLD


def test_a_closed_communicator_holds_no_store_nor_thread(pool):
    for rank, res in enumerate(pool.run(reinit_on_the_same_port, WORLD, pool.new_name(), timeout=120)):
        for round_ in range(2):
            assert res[f"sum {round_}"], (rank, res)
            # Running, it has its progress thread and its heartbeat (one host).
            assert {"pycomm-progress", "pycomm-beat"} <= set(res[f"running {round_}"]), (rank, res)
            assert res[f"left {round_}"] == [], (rank, res)


def test_the_last_reference_dropped_in_a_callback_ends_the_communicator(pool):
    for rank, res in enumerate(pool.run(last_reference_in_a_callback, WORLD, pool.new_name(), timeout=120)):
        assert res == {"collective": True, "collective threads": True, "p2p": True, "p2p threads": True,
                       "close in a callback": True, "close after": True}, (rank, res)


def test_concurrent_closes_finish_the_queue_once(pool):
    for rank, res in enumerate(pool.run(concurrent_closes, WORLD, pool.new_name(), timeout=120)):
        assert res == {"sums": True, "raised": [], "threads": True}, (rank, res)


def test_a_forked_child_neither_hangs_nor_touches_the_job():
    """Each of 2 ranks on the pycomm backend (with a communicator, the default
    one, registered memory and a GroupCommunicator) forks a child, as
    checkpoint helpers do. The
    child's calls raise, naming the fork; close() and destroy_process_group()
    leave the parent's job alone; the child exits normally (atexit handlers,
    then every inherited object released). Without the guard the child's
    all_reduce ran as the parent's next collective in the job's shared memory
    (the parent's peer raised "ranks disagree"), and a child that only exited
    hung in ~Communicator (then in ~ProcessGroupGloo of a GroupCommunicator's
    lane), waiting for the parent's threads. The parents then run 20 rounds
    of every path on fresh data."""
    out = run_script("fork_script.py", timeout=150)
    reports = sorted((json.loads(line) for line in out.splitlines() if line.startswith("{")), key=lambda r: r["rank"])
    assert [r["rank"] for r in reports] == [0, 1], out
    for r in reports:
        assert not r["child_hung"] and r["child_exit"] == 0, r
        seen = r["child"]
        for call in ("communicator", "registered", "default", "backend", "backend send", "group"):
            assert seen[call].startswith("CommError: ") and "is a fork() of it" in seen[call], (call, seen[call])
        assert seen["close"] == "ok" and seen["destroy"] == "ok", seen
        if r["rank"] == 0:  # a work in progress at the fork completes in the parent, never in the child
            assert seen["pending"].startswith("CommError: ") and "was still in progress when" in seen["pending"], seen
        assert r["pending"] is True, r
        assert r["parent_rounds_right"] == 20, r


def test_env_algorithm_is_a_preference(pool):
    for res in pool.run(env_algorithm, WORLD, pool.new_name()):
        assert res == {"all_reduce": "tree", "all_gather": "direct(two-shot)", "explicit": "ring"}


def test_all_reduce_coalesced_per_dtype(pool):
    for rank, res in enumerate(pool.run(coalesced, WORLD, pool.new_name())):
        assert res == {"plain": True, "int8": True}, f"rank {rank}: {res}"


def test_cuda_ipc_group_settings_are_checked_before_any_gpu_work():
    """pycomm.cuda_ipc.IpcAllReduce refuses an unknown quantized_kernels value
    with the values it takes, on any build; on a build without CUDA a valid
    group says so instead of failing later."""
    import torch.distributed as dist

    import pycomm

    store = dist.HashStore()
    with pytest.raises(pycomm.CommError, match="'fused' or 'split'"):
        pycomm.cuda_ipc.IpcAllReduce(store, 0, 1, quantized_kernels="fast")
    if not pycomm.load_core().has_cuda:
        with pytest.raises(pycomm.CommError, match="no CUDA support"):
            pycomm.cuda_ipc.IpcAllReduce(store, 0, 1, quantized_kernels="split", double_buffer=True)


@pytest.mark.parametrize("name, value, says", [
    ("PYCOMM_TIMEOUT", "abc", "is not a number of seconds"),
    ("PYCOMM_TIMEOUT", "-1", "finite number of seconds > 0"),
    ("PYCOMM_TIMEOUT", "0", "finite number of seconds > 0"),
    ("PYCOMM_TIMEOUT", "nan", "finite number of seconds > 0"),
    ("PYCOMM_HEARTBEAT_S", "5s", "is not a number of seconds"),
    ("PYCOMM_HEARTBEAT_S", "-2", "finite number of seconds >= 0"),
    ("PYCOMM_SPIN_US", "zz", "is not a whole number"),
    ("PYCOMM_SPIN_US", "-5", "must be at least 0"),
    ("PYCOMM_LOCAL_SIZE", "0", "must be at least 1"),
    ("PYCOMM_SHM_ROUND_BYTES", "-1", "must be a size above 0"),
    ("PYCOMM_SHM_ROUND_BYTES", "lots", "is not a size in bytes"),
    ("PYCOMM_PG_ROUND_BYTES", "-3", "must be a size above 0"),
    ("PYCOMM_P2P_BYTES", "4Q", "is not a size in bytes"),
    ("PYCOMM_PG_WINDOW", "0", "must be at least 1"),
    ("PYCOMM_BIND_CORES", "maybe", "is neither on"),
])
def test_a_malformed_environment_variable_is_refused_by_name(monkeypatch, name, value, says):
    """Each variable pycomm reads refuses a value it does not take, naming
    it, when a communicator is built: before, "5s" turned the heartbeat off,
    "-1" made every wait time out at once, "abc" raised a bare ValueError."""
    import torch.distributed as dist

    import pycomm

    monkeypatch.setenv(name, value)
    with pytest.raises(pycomm.CommError, match=f"{name}={value!r}.*{says}".replace("(", r"\(").replace(")", r"\)")):
        pycomm.Communicator(store=dist.HashStore(), rank=0, world_size=1)


def test_timeouts_given_as_arguments_are_checked(monkeypatch):
    """Explicit timeouts take what the variables take; well-formed values of
    every variable build a working communicator."""
    import datetime

    import torch
    import torch.distributed as dist

    import pycomm

    for bad in (0, -1, float("nan"), float("inf"), "soon", datetime.timedelta(seconds=-5)):
        with pytest.raises(pycomm.CommError, match="timeout="):
            pycomm.Communicator(store=dist.HashStore(), rank=0, world_size=1, timeout=bad)
    for bad in (0, -1, float("nan")):
        with pytest.raises(pycomm.CommError, match="timeout="):
            pycomm.GroupCommunicator(store=dist.HashStore(), rank=0, world_size=1, timeout=bad)
        with pytest.raises(pycomm.CommError, match="timeout="):  # before any GPU work, on any build
            pycomm.cuda_ipc.IpcAllReduce(dist.HashStore(), 0, 1, timeout=bad)
    for name, value in [("PYCOMM_TIMEOUT", " 600 "), ("PYCOMM_HEARTBEAT_S", "0"), ("PYCOMM_SPIN_US", "0"),
                        ("PYCOMM_SHM_ROUND_BYTES", "2M"), ("PYCOMM_P2P_BYTES", "1MB"), ("PYCOMM_PG_WINDOW", "2"),
                        ("PYCOMM_BIND_CORES", "No"), ("PYCOMM_LOCAL_SIZE", "")]:
        monkeypatch.setenv(name, value)
    with pycomm.Communicator(store=dist.HashStore(), rank=0, world_size=1) as comm:
        assert comm.timeout == 600.0 and comm.cpus is None
        t = torch.randn(100)
        want = t.clone()
        comm.all_reduce(t)
        assert torch.equal(t, want)
        comm.timeout = datetime.timedelta(seconds=30).total_seconds()
        assert comm.timeout == 30.0
        for bad in (0, -3, float("inf")):
            with pytest.raises(pycomm.CommError, match="timeout="):
                comm.timeout = bad
        comm.heartbeat_timeout = 0  # off
        with pytest.raises(pycomm.CommError, match="heartbeat_timeout="):
            comm.heartbeat_timeout = -1


def test_ranks_and_sizes_given_as_arguments_are_checked():
    """A rank outside the world, a world below 1, a rank that is not a whole
    number and a round size below 1 are refused at once, by name: before, a
    rank out of range waited the whole timeout for ranks that never came, a
    world of 0 raised "not enough values to unpack", and 0.5 or "0" were
    taken as rank 0."""
    import time

    import numpy as np
    import torch.distributed as dist

    import pycomm

    for kw, says in [(dict(rank=2, world_size=2), "rank=2 is not a rank of a world of 2"),
                     (dict(rank=-1, world_size=2), "rank=-1 must be at least 0"),
                     (dict(rank=0, world_size=0), "world_size=0 must be at least 1"),
                     (dict(rank=0.5, world_size=1), "rank=0.5 is not a whole number"),
                     (dict(rank="0", world_size=1), "rank='0' is not a whole number"),
                     (dict(rank=True, world_size=2), "rank=True is not a whole number"),
                     (dict(rank=0, world_size=1, round_bytes=-5), "round_bytes=-5 must be at least 1")]:
        start = time.monotonic()
        with pytest.raises(pycomm.CommError, match=says):
            pycomm.Communicator(store=dist.HashStore(), timeout=30, **kw)
        assert time.monotonic() - start < 10, kw  # at once, not at the timeout
    with pycomm.Communicator(store=dist.HashStore(), rank=np.int64(0), world_size=np.int32(1)) as comm:
        assert (comm.rank, comm.world_size) == (0, 1)
