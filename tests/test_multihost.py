"""Beyond one host.

* The collective matrix with every transfer forced through the process-group
  transport (one host, Gloo over loopback), world sizes 1-8.
* The matrix on simulated hosts (``local_size`` override: consecutive blocks
  of ranks count as hosts), where "auto" and "hierarchical" run shared memory
  inside a host and the process group between hosts.
* Compressed all-reduce and all-to-all over both.
* Errors across hosts: ranks that disagree (also where the per-host shards
  would agree), a late peer, a killed peer: CommError on every rank, no hang.
* The tuner's choices; and, where network namespaces work (root), a real run
  on the multi-host testbed (benchmarks/multihost/testbed.py).
"""
import os
import subprocess
import sys
import tempfile

import pytest
import torch

import pycomm
from collective_cases import DTYPES, check_reduction, make_input, matrix_failures, sweep
from compressed_cases import run_all_to_all, run_cases, run_mismatch
from error_cases import abort_between_hosts, late_peer, mismatch, stream_until_killed
from harness import RankPool, no_private_mounts
from multihost_cases import STREAM_KINDS, STREAM_SIZES, mixed_stream, topology

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALGOS = {
    "all_reduce": ["ring", "tree", "direct", "auto", "hierarchical"],
    "reduce_scatter": ["ring", "direct", "auto", "hierarchical"],
    "all_gather": ["ring", "direct", "auto", "hierarchical"],
    "broadcast": ["ring", "tree", "direct", "auto", "hierarchical"],
}
PG_WORLDS = [1, 2, 3, 5]
# (hosts, ranks per host)
LAYOUTS = [(2, 2), (3, 2), (2, 3), (2, 4), (4, 1)]
LONG = os.environ.get("PYCOMM_LONG") == "1"


def matrix_dtypes(layout: int, coll: str):
    """The dtypes one (layout, collective) case sweeps. PYCOMM_LONG=1: all.
    CI: float32 (every op, the largest count) and one more, turning with the
    layout and the collective, so that each collective crosses hosts in every
    dtype and each layout in four of the five others: what a layout changes
    (who is a leader, how shards fall at every count) is the same code for
    every dtype, and the dtypes' own reductions are swept in full on one host
    (test_collectives) and here on the process group at world 5."""
    if LONG:
        return DTYPES
    others = DTYPES[1:]
    return [DTYPES[0], others[(layout + list(ALGOS).index(coll)) % len(others)]]


def _assert_matrix(per_rank):
    failures = matrix_failures(per_rank)
    assert not failures, f"{len(failures)} failing cases of {len(per_rank[0])}:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("coll", list(ALGOS))
@pytest.mark.parametrize("world", PG_WORLDS)
def test_matrix_over_the_process_group(pool8, coll, world):
    dtypes = DTYPES if world == PG_WORLDS[-1] else matrix_dtypes(PG_WORLDS.index(world), coll)
    _assert_matrix(pool8.run(sweep, world, pool8.new_name(), coll, ALGOS[coll], dtypes, world=world, transport="pg"))


@pytest.mark.parametrize("coll", list(ALGOS))
@pytest.mark.parametrize("hosts,local", LAYOUTS)
def test_matrix_on_simulated_hosts(pool8, coll, hosts, local):
    world = hosts * local
    dtypes = matrix_dtypes(LAYOUTS.index((hosts, local)), coll)
    _assert_matrix(pool8.run(sweep, world, pool8.new_name(), coll, ALGOS[coll], dtypes, world=world,
                             local_size=local))


def test_topology_and_tuner_choices(pool8):
    sizes = [1024, 1 << 20, 64 << 20]
    res = pool8.run(topology, 4, pool8.new_name(), sizes, world=4, local_size=2)
    assert [(r["host"], r["local_rank"]) for r in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for r in res:
        assert (r["num_hosts"], r["local_size"], r["transport"]) == (2, 2, "shm+process_group")
        # Small tensors through one leader per host, large ones sharded over
        # every local rank; "ring" is a flat ring over all ranks.
        assert r["auto"][1024].startswith("hier(leader)+"), r["auto"]
        assert r["auto"][64 << 20].startswith("hier(shard)+"), r["auto"]
        assert r["hier_rs"].startswith("hier(shard)+"), r["hier_rs"]
        assert r["ring"] == "ring"
    one = pool8.run(topology, 2, pool8.new_name(), sizes, world=2)
    assert all(r["num_hosts"] == 1 and r["transport"] == "shm" for r in one)
    forced = pool8.run(topology, 2, pool8.new_name(), sizes, world=2, transport="pg")
    assert all(r["transport"] == "process_group" for r in forced)


def test_tuner_is_a_pure_function():
    core = pycomm.load_core()
    ar, rs, bc = 0, 1, 3
    hier = pycomm.ALGORITHMS["hierarchical"]
    assert core.tune_multihost(0, ar, 1 << 26, 4, 1) == ("ring", "ring")  # one rank per host: flat
    assert core.tune_multihost(0, ar, 1000, 4, 1)[0] == "direct(one-shot)"
    assert core.tune_multihost(3, ar, 1 << 26, 4, 1)[0] == "direct(two-shot)"  # "direct" stays direct
    assert core.tune_multihost(0, ar, 100, 4, 2) == ("hier(leader)", "direct(one-shot)")
    assert core.tune_multihost(0, ar, 1 << 26, 2, 4) == ("hier(shard)", "ring")
    assert core.tune_multihost(0, ar, 1 << 20, 2, 2) == ("ring", "ring")  # mid sizes: flat
    assert core.tune_multihost(hier, ar, 1 << 20, 2, 2)[0] == "hier(shard)"  # unless asked
    assert core.tune_multihost(hier, rs, 1 << 20, 2, 2)[0] == "hier(shard)"
    assert core.tune_multihost(0, bc, 1 << 26, 3, 2) == ("hier(shard)", "ring")
    # Hosts of different sizes: flat only.
    assert core.tune_multihost(hier, ar, 1 << 26, 3, 0)[0] == "ring"
    # Between hosts one-shot lasts while what each rank sends, (hosts - 1) x the
    # tensor, stays within a budget (96 KiB measured at 1 Gbit/s): the more
    # hosts, the sooner the ring takes over.
    for hosts, last_one_shot in ((2, 64 << 10), (3, 32 << 10), (4, 32 << 10), (8, 8 << 10)):
        assert core.tune_multihost(0, ar, last_one_shot, hosts, 1)[0] == "direct(one-shot)", hosts
        assert core.tune_multihost(0, ar, 2 * last_one_shot, hosts, 1)[0] == "ring", hosts
        assert core.tune_multihost(0, bc, 2 * last_one_shot, hosts, 1)[0] == "ring", hosts


@pytest.mark.parametrize("kw", [dict(transport="pg"), dict(local_size=2)], ids=["pg", "2x2"])
def test_async_stream_of_mixed_collectives(pool8, kw):
    world, steps = 4, 24
    per_rank = pool8.run(mixed_stream, world, pool8.new_name(), steps, world=world, **kw)
    for i in range(steps):
        n = STREAM_SIZES[i % len(STREAM_SIZES)]
        kind = STREAM_KINDS[i % len(STREAM_KINDS)]
        for r in range(world):
            got = per_rank[r][i]
            if kind == "all_reduce":
                err = check_reduction(got, [make_input(i, q, n, torch.float32) for q in range(world)], "sum",
                                      torch.float32)
                assert err is None, (i, r, err)
            elif kind == "all_gather":
                assert torch.equal(got, torch.cat([make_input(i, q, n, torch.float32) for q in range(world)])), (i, r)
            elif kind == "broadcast":
                assert torch.equal(got, make_input(i, i % world, n, torch.float32)), (i, r)
            else:
                xs = [make_input(i, q, world * n, torch.float32)[r * n:(r + 1) * n] for q in range(world)]
                assert check_reduction(got, xs, "sum", torch.float32) is None, (i, r)


@pytest.mark.parametrize("kw,world", [(dict(transport="pg"), 3), (dict(local_size=2), 4), (dict(local_size=1), 3)],
                         ids=["pg", "2x2", "3x1"])
def test_compressed_all_reduce_and_all_to_all(pool8, kw, world):
    from test_compressed_collectives import check_case

    cases = []
    for seed, codec in enumerate(("int8", "int4-stoch", "topk")):
        for n in (1, 1021, 16411):
            cases.append((100 + seed * 10 + n % 7, codec, n, torch.float32, "sum"))
    per_rank = pool8.run(run_cases, world, pool8.new_name(), cases, world=world, **kw)
    for i, case in enumerate(cases):
        check_case(case, [res[i] for res in per_rank], world)
    outs = pool8.run(run_all_to_all, world, pool8.new_name(), 1000, torch.float64, world=world, **kw)
    xs = [make_input(77, r, world * 1000, torch.float64) for r in range(world)]
    for r, out in enumerate(outs):
        exp = torch.cat([xs[q][r * 1000:(r + 1) * 1000] for q in range(world)])
        assert torch.equal(out, exp)
    msgs = pool8.run(run_mismatch, world, pool8.new_name(), world=world, **kw)
    assert all("disagree" in m for m in msgs), msgs


@pytest.mark.parametrize("kind", ["count", "count, same shards", "dtype", "op", "collective", "algorithm", "root",
                                  "invalid on one rank", "barrier vs all_reduce"])
@pytest.mark.parametrize("kw,odd", [(dict(local_size=2), 1), (dict(local_size=2), 2), (dict(transport="pg"), 2)],
                         ids=["2x2-same-host", "2x2-other-host", "pg"])
def test_mismatch_raises_on_every_rank(pool8, kind, kw, odd):
    if kind == "count, same shards":
        kind = "count"  # 999 vs 1000 elements: 500-element shards on 2 local ranks either way
    results = pool8.run(mismatch, 4, pool8.new_name(), kind, odd_rank=odd, world=4, timeout=60, **kw)
    for rank, (first, after) in enumerate(results):
        assert first and first.startswith("CommError: "), f"rank {rank}: {first}"
        if kind == "invalid on one rank" and rank == odd:
            assert "not contiguous" in first
        else:
            assert "disagree" in first or "invalid" in first, f"rank {rank}: {first}"
        assert after and after.startswith("CommError: "), f"rank {rank} continued after a mismatch: {after}"


@pytest.mark.parametrize("kw", [dict(transport="pg"), dict(local_size=1)], ids=["pg", "3x1"])
def test_late_peer_times_out_on_time(pool8, kw):
    timeout = 1.5
    results = pool8.run(late_peer, 3, pool8.new_name(), timeout, world=3, timeout=60, **kw)
    err0, elapsed0 = results[0]
    assert err0 and "Timed out waiting" in err0 and "rank 1" in err0, err0
    assert elapsed0 < timeout + 1.0, elapsed0
    assert results[1][0], "the late rank went on as if nothing happened"


@pytest.mark.parametrize("kw,world,aborter,receiver", [(dict(transport="pg"), 3, 1, 2), (dict(local_size=1), 2, 0, 1),
                                                        (dict(local_size=2), 4, 0, 2)], ids=["pg", "2x1", "2x2"])
def test_an_abort_fails_every_host_at_once(pool8, kw, world, aborter, receiver):
    """A rank that aborts fails the all-reduce its peers on other hosts wait
    in, and their later ones, with its reason, within about a beat period
    (the heartbeat board's mark), as it does on its own host: they waited for
    the whole timeout (30 s) before. What it sent before the abort is still
    delivered, and every close is prompt."""
    out = pool8.run(abort_between_hosts, world, pool8.new_name(), aborter, receiver, world=world, timeout=120, **kw)
    reason = f"rank {aborter}'s step raised"
    for rank, r in enumerate(out):
        assert r["close_s"] < 5, (rank, r)
        if rank == aborter:
            continue
        for key in ("current", "later"):
            assert r[key] and r[key].startswith("CommError: ") and reason in r[key], (rank, key, r)
            assert r[key + "_s"] < 10, (rank, key, r)
    assert out[receiver]["message"] == 0.0, out[receiver]


@pytest.mark.parametrize("kw,world,victim", [(dict(transport="pg"), 3, 1), (dict(local_size=2), 4, 2)],
                         ids=["pg", "2x2"])
def test_killed_rank_fails_every_survivor_in_time(kw, world, victim):
    """kill -9 one rank in a stream of collectives: every survivor raises
    CommError within the timeout (+1 s), and ranks that wait on it directly
    name it."""
    before = set(os.listdir("/dev/shm"))
    timeout = 4.0
    pool = RankPool(world)
    try:
        out = pool.run_expect(stream_until_killed, world, pool.new_name(), victim, 23, timeout, timeout=120, **kw)
    finally:
        pool.close()
    named = 0
    for rank, (status, value) in enumerate(out):
        if rank == victim:
            assert status == "dead", (rank, status, value)
            continue
        assert status == "ok", (rank, value)
        err, noticed_after, _ = value
        assert err, f"rank {rank} never noticed"
        assert noticed_after < timeout + 1.0, (rank, noticed_after, err)
        named += f"rank {victim}" in err
    assert named >= 1, [v for _, v in out]
    leaked = [f for f in set(os.listdir("/dev/shm")) - before if f.startswith("pycomm.")]
    assert not leaked, leaked


def _testbed():
    sys.path.insert(0, os.path.join(ROOT, "benchmarks", "multihost"))
    import testbed

    return testbed


def test_testbed_two_hosts_two_ranks_each():
    """The real thing: two network namespaces joined by a shaped link."""
    if os.geteuid() != 0:
        pytest.skip("the multi-host testbed needs root")
    tb = _testbed()
    why = tb.supported()
    if why:
        pytest.skip(f"network namespaces unavailable here: {why}")
    env = {"PYTHONPATH": os.pathsep.join([os.path.join(ROOT), os.environ.get("PYTHONPATH", "")])}
    with tempfile.TemporaryFile(mode="w+") as log, tb.Testbed(hosts=2, rate="1gbit", delay="0.1ms") as bed:
        code = bed.launch(2, [os.path.join(ROOT, "tests", "testbed_check.py")], env=env, timeout=240, stdout=log)
        log.seek(0)
        text = log.read()
    assert code == 0, text[-3000:]
    assert "testbed-check ok hosts=2 local_size=2 transport=shm+process_group" in text, text[-3000:]
    # Nothing of the testbed is left behind.
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert bed.token not in left


SEPARATE_SHM = r"""
import os, torch, torch.distributed as dist, pycomm
dist.init_process_group("gloo")
comm = pycomm.Communicator(timeout=60)
t = torch.full((1 << 16,), float(comm.rank + 1))
comm.all_reduce(t)
os.write(1, f"RESULT {comm.rank} hosts={comm.num_hosts} local={comm.local_size} host={comm.host} "
            f"transport={comm.transport} sum={t[0].item()}\n".encode())  # one write: ranks share the pipe
comm.close()
"""


def test_a_dev_shm_of_its_own_makes_another_host():
    """Containers of one machine with its hostname and network but each its
    own /dev/shm (no --ipc=host) cannot open each other's segments: ranks
    there count as separate hosts and talk through the process group (before,
    they counted as one host and failed to attach)."""
    why = no_private_mounts()
    if why:
        pytest.skip(why)
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "rank.py")
        with open(script, "w") as f:
            f.write(SEPARATE_SHM)
        port = str(29700 + os.getpid() % 200)
        def shq(r: int, lr: int) -> str:
            return f"RANK={r} LOCAL_RANK={lr} {sys.executable} {script}"

        # Ranks 0 and 1 here; 2 and 3 in a mount namespace with a tmpfs of their own at /dev/shm.
        launch = (f"{shq(0, 0)} & {shq(1, 1)} & "
                  f"unshare -m sh -c 'mount -t tmpfs -o size=64m tmpfs /dev/shm && "
                  f"{{ {shq(2, 0)} & {shq(3, 1)} & wait; }}' ; wait")
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "4",
               "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
        r = subprocess.run(["sh", "-c", launch], capture_output=True, text=True, env=env, timeout=180)
    results = {int(line.split()[1]): line.split()[2:] for line in r.stdout.splitlines() if line.startswith("RESULT")}
    assert sorted(results) == [0, 1, 2, 3], r.stdout[-2000:] + r.stderr[-3000:]
    for rank, fields in results.items():
        assert fields[:2] == ["hosts=2", "local=2"] and fields[3:] == ["transport=shm+process_group", "sum=10.0"], \
            (rank, fields)
    assert results[0][2] == results[1][2] != results[2][2] == results[3][2], results
