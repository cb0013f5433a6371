"""Errors, not hangs: bad input, ranks that disagree, a late peer and a dead
peer all raise pycomm.CommError on every rank, with a message naming the
cause, and nothing is left behind in /dev/shm."""
import json
import os
import subprocess
import sys

import pytest

from error_cases import (bad_inputs, late_peer, mismatch, missing_rank, other_build, sparse_on_one_rank,
                         stream_until_killed)
from harness import RankPool, no_private_mounts

WORLD = 3


@pytest.fixture(scope="module")
def pool3():
    pool = RankPool(WORLD)
    before = set(os.listdir("/dev/shm"))
    yield pool
    pool.close()
    leaked = [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("pycomm.")]
    assert not leaked, f"shared memory left behind: {leaked}"


EXPECTED_WORDS = {
    "non-contiguous": "not contiguous",
    "int16 sum": "reductions take",
    "complex": "reductions take",
    "band on float": "integral or bool",
    "meta device": "takes CPU tensors only",
    "output size": "elements",
    "output dtype": "dtype",
    "partial overlap": "overlap",
    "avg on int": "floating-point",
    "unknown op": "unsupported reduce op",
    "unknown algorithm": "unknown algorithm",
    "tree for all_gather": "not available",
    "reduce_scatter sizes": "world_size",
    "reduce_scatter overlap": "not this rank's block",
    "all_gather sizes": "world_size",
    "broadcast src": "src=",
    "async list all_gather": "flat output",
    "wrapper subclass": "without storage of its own",
    "wrapper subclass, compressed": "without storage of its own",
    "wrapper subclass output": "without storage of its own",
    "negative view": "tensor.resolve_neg()",
    "nested": "nested",
}


def test_bad_input_raises_on_every_rank_and_keeps_the_communicator(pool3):
    results = pool3.run(bad_inputs, WORLD, pool3.new_name())
    assert [label for label, _, _ in results[0]] == list(EXPECTED_WORDS)
    for rank, per_case in enumerate(results):
        for label, err, usable in per_case:
            assert err and err.startswith("CommError: "), f"rank {rank} {label}: {err}"
            assert EXPECTED_WORDS[label] in err, f"rank {rank} {label}: unclear message {err!r}"
            assert usable, f"rank {rank} {label}: communicator broken after a rejected call"


@pytest.mark.parametrize("kind", ["count", "dtype", "op", "collective", "algorithm", "root",
                                  "invalid on one rank", "barrier vs all_reduce"])
def test_mismatch_raises_on_every_rank(pool3, kind):
    results = pool3.run(mismatch, WORLD, pool3.new_name(), kind, timeout=60)
    for rank, (first, after) in enumerate(results):
        assert first and first.startswith("CommError: "), f"rank {rank}: {first}"
        if kind == "invalid on one rank" and rank == 1:
            assert "not contiguous" in first
        else:
            assert "disagree" in first or "invalid" in first, f"rank {rank}: {first}"
        # Ranks that disagree have lost step: the communicator stays failed.
        assert after and after.startswith("CommError: "), f"rank {rank} continued after a mismatch: {after}"


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "int8"])
@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_sparse_tensor_on_one_rank_fails_every_rank_promptly(pool3, layout, compressed):
    """The communicator's timeout is 20 s: every rank must raise CommError long before."""
    results = pool3.run(sparse_on_one_rank, WORLD, pool3.new_name(), layout, compressed, timeout=60)
    for rank, (err, elapsed) in enumerate(results):
        assert err and err.startswith("CommError: "), f"rank {rank}: {err}"
        if rank == 1:
            assert "dense" in err, err
        else:
            assert "disagree" in err and "could not run" in err, f"rank {rank}: {err}"
        assert elapsed < 5.0, f"rank {rank} took {elapsed:.1f} s"


def test_late_peer_times_out_on_time(pool3):
    timeout = 1.5
    results = pool3.run(late_peer, WORLD, pool3.new_name(), timeout, timeout=60)
    err0, elapsed0 = results[0]
    assert err0 and "Timed out waiting" in err0 and "rank 1" in err0, err0
    assert elapsed0 < timeout + 1.0, elapsed0
    # The late rank finds the communicator aborted instead of waiting again.
    assert results[1][0] and "Timed out waiting" in results[1][0]


def test_rank_that_never_joins_fails_the_bootstrap(pool3):
    results = pool3.run(missing_rank, WORLD, pool3.new_name(), 1.5, timeout=60)
    for rank, err in enumerate(results[:-1]):
        assert err and "Timed out waiting" in err and "ranks 2 never arrived" in err, f"rank {rank}: {err}"
    # The pool fixture checks that the failed bootstrap left no segment.


def test_ranks_of_different_builds_refuse_each_other_by_name(pool3):
    results = pool3.run(other_build, WORLD, pool3.new_name(), timeout=60)
    for rank, err in enumerate(results):
        assert err and "builds of pycomm that cannot talk to each other" in err, f"rank {rank}: {err}"
        assert "ranks 0, 1 run pycomm " in err and "rank 2 runs pycomm 9.9-" in err, err
        assert "(wire version " in err


def test_killed_rank_is_named_by_every_survivor():
    """kill -9 one rank in the middle of a stream of collectives."""
    before = set(os.listdir("/dev/shm"))
    timeout = 5.0
    for trial, (victim, after) in enumerate([(1, 37), (0, 11), (2, 58)]):
        pool = RankPool(WORLD)
        try:
            out = pool.run_expect(stream_until_killed, WORLD, pool.new_name(), victim, after, timeout, timeout=120)
        finally:
            pool.close()
        for rank, (status, value) in enumerate(out):
            if rank == victim:
                assert status == "dead", (trial, rank, status, value)
                continue
            assert status == "ok", (trial, rank, value)
            err, noticed_after, _ = value
            assert err and f"rank {victim}" in err and "died" in err, (trial, rank, err)
            assert noticed_after < timeout + 1.0, (trial, rank, noticed_after)
    leaked = [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("pycomm.")]
    assert not leaked, leaked


# In a mount namespace of its own, one process imports torch and pycomm once
# and, per case, mounts a small tmpfs at /dev/shm, forks a store process (it
# outlives the ranks, as torchrun's does) and two ranks that try a
# communicator (or DeadlineAverager's shared file), then lists what is left
# and unmounts: a launch per case (torchrun and three interpreters) took ~9 s
# of imports for ~1 s of test.
ROOM_DRIVER = r"""
import json, os, signal, subprocess, sys
import torch, torch.distributed as dist, pycomm


def rank_main(mode, rank, port):
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", port, is_master=False), rank=rank,
                            world_size=2)
    try:
        if mode == "deadline":  # 1M float32 in each of 2 + 2 slots: 16 MiB
            p = torch.nn.Parameter(torch.zeros(1 << 20))
            pycomm.DeadlineAverager(torch.optim.SGD([p], lr=1.0), deadline=0.01, ring=2)
            return "no error"
        comm = pycomm.Communicator()
        t = torch.ones(1 << 16)
        comm.all_reduce(t)
        if comm.rank == 0:
            comm.send(t, 1)
        else:
            comm.recv(0, out=t)
        return "ok"
    except pycomm.CommError as e:
        return f"CommError {e}"


out = {}
for case, mount, mode in json.loads(sys.argv[1]):
    subprocess.run(["mount", "-t", "tmpfs", "-o", mount, "tmpfs", "/dev/shm"], check=True)
    port_r, port_w = os.pipe()
    stop_r, stop_w = os.pipe()
    store_pid = os.fork()
    if store_pid == 0:  # the store: serves until the driver closes stop_w
        os.close(stop_w)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(port_w, str(store.port).encode())
        os.read(stop_r, 1)
        os._exit(0)
    os.close(port_w), os.close(stop_r)
    port = int(os.read(port_r, 16))
    os.close(port_r)
    ranks = []
    for rank in range(2):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r), os.close(stop_w)
            os.environ["LOCAL_RANK"] = str(rank)
            try:
                said = rank_main(mode, rank, port)
            except BaseException as e:
                said = f"{type(e).__name__}: {e}"
            os.write(w, said.encode())
            os._exit(0)
        os.close(w)
        ranks.append((pid, r))
    said = []
    for pid, r in ranks:
        with os.fdopen(r, "rb") as f:
            text = f.read().decode()  # to the rank's end (the test's timeout bounds a hang)
        status = os.waitpid(pid, 0)[1]
        if os.WIFSIGNALED(status):
            text += f" [killed by {signal.Signals(os.WTERMSIG(status)).name}]"
        said.append(text)
    os.close(stop_w)
    os.waitpid(store_pid, 0)
    out[case] = {"said": said, "left": sorted(os.listdir("/dev/shm"))}
    subprocess.run(["umount", "/dev/shm"], check=True)
print("ROOM " + json.dumps(out), flush=True)
"""

ROOM_CASES = [
    ("size=1m", "cannot size shared memory segment", "comm", "/dev/shm more room"),
    ("size=3m", "cannot size point-to-point segment", "comm", "/dev/shm more room"),
    ("size=8m", "cannot take 16777216 bytes", "deadline", "/dev/shm more room"),
    ("ro,size=8m", "Read-only file system", "comm", "PYCOMM_TRANSPORT=pg"),
]


@pytest.fixture(scope="module")
def no_room():
    """What each ROOM_CASES case's ranks said, and what they left in /dev/shm."""
    why = no_private_mounts()
    if why:
        pytest.skip(why)
    # The segment takes ~2 MiB with these sizes, a point-to-point ring ~1 MiB.
    env = {**os.environ, "PYCOMM_SHM_ROUND_BYTES": "256K", "PYCOMM_P2P_BYTES": "1M", "PYCOMM_TIMEOUT": "60",
           "OMP_NUM_THREADS": "1"}
    cases = json.dumps([(i, mount, mode) for i, (mount, _, mode, _) in enumerate(ROOM_CASES)])
    r = subprocess.run(["unshare", "-m", sys.executable, "-c", ROOM_DRIVER, cases], capture_output=True, text=True,
                       env=env, timeout=300)
    line = next((line for line in r.stdout.splitlines() if line.startswith("ROOM ")), None)
    assert line and r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return {int(case): res for case, res in json.loads(line[len("ROOM "):]).items()}


@pytest.mark.parametrize("case", range(len(ROOM_CASES)), ids=["-".join(c) for c in ROOM_CASES])
def test_no_room_in_dev_shm_is_an_error_on_every_rank_not_a_crash(no_room, case):
    """/dev/shm as small as a container's: ranks raise CommError saying so, at
    setup (the collective segment) or at the first message (a point-to-point
    ring; DeadlineAverager's shared file when built); before, a tmpfs that could
    not back a page killed them with SIGBUS. A read-only /dev/shm is named too."""
    _, fails, _, advice = ROOM_CASES[case]
    said, left = no_room[case]["said"], no_room[case]["left"]
    for rank, text in enumerate(said):
        assert text.startswith("CommError") and "killed by" not in text, (rank, text)
    said = " ".join(said)
    # The rank that hit the full tmpfs says so and what to do; its peer is not left waiting.
    assert fails in said and advice in said.replace("Give", "give"), said
    assert left == [], left
