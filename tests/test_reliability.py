"""The reliability and security suite: peer death at random moments, ranks
that disagree, fuzzed bad input, a soak, oversubscription, isolation between
jobs, private segments, stale segments, elastic restart.

Quick versions run in CI. PYCOMM_LONG=1 runs the long versions whose
figures are in RELIABILITY.md.
"""
import os
import re
import stat
import statistics
import subprocess
import sys
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import reliability_cases as rc
from collective_cases import matrix_failures, sweep
from error_cases import _outcome
from harness import RankPool, free_port, make_comm

LONG = os.environ.get("PYCOMM_LONG") == "1"


def _count(name: str, ci: int, long: int) -> int:
    """How many trials or calls: CI's, PYCOMM_LONG's, or the environment's
    ``name`` (tests/sanitize.sh runs sanitizer builds with its own counts)."""
    return int(os.environ.get(name) or (long if LONG else ci))


HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def zygote():
    z = rc.Zygote()
    yield z
    z.close()


@pytest.fixture(scope="module")
def pool4():
    pool = RankPool(4)
    before = rc.shm_entries()
    yield pool
    pool.close()
    leaked = rc.shm_entries() - before
    assert not leaked, f"shared memory left behind: {leaked}"


# ------------------------------------------------------------------ peer death


def _death_trials(zygote, trials, comm_kwargs=None, worlds=(2, 3, 4, 5, 8), timeout=5.0, seed=1000):
    failures, detect = [], []
    for i in range(trials):
        world = worlds[i % len(worlds)]
        res = zygote.run(rc.death_trial, world, seed + i, timeout, comm_kwargs, timeout=timeout + 90)
        victim = res["victim"]
        where = f"trial {i} (world {world}, rank {victim} killed after {res['delay']:.2f} s)"
        if res["hung"]:
            failures.append(f"{where}: {res['hung']} rank(s) hung")
        if res["leaked"]:
            failures.append(f"{where}: left {res['leaked']} in /dev/shm")
        for r, rep in res["reports"].items():
            err, after = rep["err"], rep["after_kill"]
            if rep["wrong"]:
                failures.append(f"{where}: rank {r} got wrong results: {rep['wrong'][:2]}")
            if err is None:
                failures.append(f"{where}: rank {r} never raised")
                continue
            if not err.startswith("CommError") or f"rank {victim}" not in err:
                failures.append(f"{where}: rank {r} raised {err!r}, which does not name rank {victim}")
            # The blame is structured too: programs need not parse the message.
            if rep["blamed"] != victim or rep["failure"] not in ("died", "silent"):
                failures.append(f"{where}: rank {r} blames {rep['blamed']} ({rep['failure']}), not rank {victim}")
            if after > timeout + 1.0:
                failures.append(f"{where}: rank {r} raised {after:.2f} s after the kill (timeout {timeout} s)")
            detect.append(after)
    return failures, detect


def test_peer_death_random_rank_random_moment(zygote):
    """kill -9 a random rank at a random moment of a random checked stream:
    every survivor raises CommError naming it within timeout + 1 s; no hang,
    no wrong result, nothing left in /dev/shm."""
    failures, detect = _death_trials(zygote, _count("PYCOMM_DEATH_TRIALS", 10, 200))
    print(f"\npeer death: {len(detect)} survivors, detection median {statistics.median(detect):.3f} s, "
          f"max {max(detect):.3f} s")
    assert not failures, "\n".join(failures[:20])


def test_peer_death_across_hosts(zygote):
    """The same with two simulated hosts (shared memory inside, a process
    group between them)."""
    failures, detect = _death_trials(zygote, 40 if LONG else 4, dict(local_size=2), worlds=(4,), timeout=4.0)
    print(f"\npeer death, 2 hosts: {len(detect)} survivors, max detection {max(detect):.3f} s")
    assert not failures, "\n".join(failures[:20])


def test_kill_and_freeze_trials_with_8_ranks(zygote):
    """8 ranks (more than cores): kill -9 at a random moment, and SIGSTOP
    until the heartbeat verdict, shrink and fence, in turns. Under a
    sanitizer build (tests/sanitize.sh) these are the trials that must pass
    200 times in a row."""
    import elastic_cases as ec

    trials = _count("PYCOMM_TRIALS_8", 2, 20)
    for i in range(trials):
        if i % 2 == 0:
            failures, _ = _death_trials(zygote, 1, worlds=(8,), timeout=10.0, seed=5000 + i)
            assert not failures, f"kill trial {i}:\n" + "\n".join(failures[:20])
            continue
        res = zygote.run(ec.freeze_and_shrink, 8, 2.0, {}, timeout=180)
        assert res["hung"] == 0, f"freeze trial {i}: {res}"
        for r in range(7):
            rep = res["reports"][r]
            assert rep and rep["wrong"] == 0 and rep["members"] == list(range(7)), (i, r, rep)
            assert rep["blamed"] == 7 and rep["failure"] == "silent", (i, r, rep)
        assert "fenced out" in (res["reports"][7] or {}).get("fenced", ""), (i, res["reports"][7])


# ------------------------------------------------------------ mismatch matrix


def _pairs(rank, world, name):
    """Rank 1 calls collective B where the others call A, for every ordered
    pair; each case on a fresh communicator. Returns outcomes per pair."""
    import torch

    n = 12
    calls = {
        "all_reduce": lambda c: c.all_reduce(torch.ones(n)),
        "reduce_scatter": lambda c: c.reduce_scatter(torch.empty(n), torch.ones(n * world)),
        "all_gather": lambda c: c.all_gather(torch.empty(n * world), torch.ones(n)),
        "broadcast": lambda c: c.broadcast(torch.ones(n)),
        "all_to_all": lambda c: c.all_to_all_single(torch.empty(n * world), torch.ones(n * world)),
        "barrier": lambda c: c.barrier(),
        "compressed": lambda c: c.all_reduce(torch.ones(n), compression=__import__("pycomm").Int8()),
    }
    out = {}
    for a in calls:
        for b in calls:
            if a == b:
                continue
            comm = make_comm(rank, world, f"{name}/{a}/{b}", timeout=20)
            out[f"{a} vs {b}"] = _outcome(lambda: calls[b if rank == 1 else a](comm))
            comm.close()
    return out


def test_mismatch_matrix_every_pair_of_collectives(pool4):
    results = pool4.run(_pairs, 3, pool4.new_name(), world=3)
    for rank, per in enumerate(results):
        for case, err in per.items():
            assert err and err.startswith("CommError"), f"rank {rank}, {case}: {err}"
            assert "disagree" in err or "invalid" in err, f"rank {rank}, {case}: unclear {err!r}"


# ----------------------------------------------------------------- fuzzing


def _mostly(good, bad):
    """Good values three times as likely as bad ones, so that valid calls
    (which must succeed, and be right) are common too."""
    return st.sampled_from(list(good) * 3 + list(bad))


CASE = st.fixed_dictionaries({
    "coll": st.sampled_from(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]),
    "dtype": _mostly(sorted(rc.REDUCIBLE), sorted(set(rc.FUZZ_DTYPES) - rc.REDUCIBLE)),
    "n": st.sampled_from(rc.FUZZ_SIZES),
    "layout": _mostly(["contiguous", "offset"], ["transposed", "strided", "expanded"]),
    "device": _mostly(["cpu"] * 3, ["meta"]),
    "op": _mostly(rc.GOOD_OPS, rc.BAD_OPS),
    "algorithm": _mostly(rc.FUZZ_ALGOS[:5], rc.FUZZ_ALGOS[5:]),
    "output": _mostly(rc.OUTPUTS[:2], rc.OUTPUTS[2:]),
    "root": _mostly([0, 1, 2], [-1, 3]),
    "salt": st.integers(0, 10),
})


def test_fuzzed_calls_give_a_correct_result_or_a_clear_error(pool4):
    world = 3
    name = pool4.new_name("fuzz")
    seen = {"ok": 0, "err": 0}

    @settings(max_examples=_count("PYCOMM_FUZZ_EXAMPLES", 200, 1500), deadline=None, derandomize=not LONG,
              suppress_health_check=list(HealthCheck))
    @given(case=CASE)
    def check(case):
        out = pool4.run(rc.fuzz_one, world, name, case, world=world)
        problems = rc.fuzz_problems(case, world)
        if not problems:
            assert all(o == ("ok", True) for o in out), (case, out)
            seen["ok"] += 1
            return
        assert all(o[0] == "err" for o in out), (case, problems, out)
        assert len({o for o in out}) == 1, f"ranks raised different errors: {case} {out}"
        _, kind, msg = out[0]
        assert kind == "CommError" and msg.startswith("pycomm"), (case, out[0])
        assert any(p in msg for p in problems), f"{case}: {msg!r} names none of {problems}"
        seen["err"] += 1

    check()
    print(f"\nfuzz: {seen['ok']} valid calls correct, {seen['err']} invalid calls rejected clearly")
    assert seen["ok"] > 20 and seen["err"] > 20, seen


# ------------------------------------------------------------------- soak


def test_soak_flat_memory_fds_and_shm(pool4):
    calls = _count("PYCOMM_SOAK_CALLS", 1200, 20000)
    results = pool4.run(rc.soak, 4, pool4.new_name("soak"), calls, 99)
    for rank, res in enumerate(results):
        assert not res["wrong"], f"rank {rank}: {res['wrong'][:3]}"
        (rss0, fds0, shm0), (rss1, fds1, shm1) = res["warm"], res["end"]
        assert fds1 == fds0, f"rank {rank}: open fds {fds0} -> {fds1}"
        assert shm1 == shm0, f"rank {rank}: /dev/shm entries {shm0} -> {shm1}"
        assert rss1 - rss0 < 16, f"rank {rank}: RSS grew {rss1 - rss0:.1f} MiB over {calls} calls"
    print(f"\nsoak: {calls} calls x 4 ranks in {results[0]['seconds']:.1f} s; "
          f"RSS {results[0]['warm'][0]:.1f} -> {results[0]['end'][0]:.1f} MiB")


# ---------------------------------------------------------- oversubscription

# 8 ranks on 2 cores: the whole matrix of one collective (every algorithm,
# dtype, op and count) finishes well inside this bound; it takes a few
# seconds (RELIABILITY.md). A rank spinning instead of sleeping would blow it.
OVERSUBSCRIBED_BOUND_S = 60


def test_oversubscribed_matrix_within_bound():
    if (os.cpu_count() or 1) > 4 and not LONG:
        pytest.skip("needs more ranks than cores")
    pool = RankPool(8)
    try:
        for coll, algos in (("all_reduce", ["ring", "tree", "direct"]), ("all_gather", ["ring", "direct"])):
            t0 = time.monotonic()
            per_rank = pool.run(sweep, 8, pool.new_name(), coll, algos)
            elapsed = time.monotonic() - t0
            assert not matrix_failures(per_rank)
            print(f"\n8 ranks on {os.cpu_count()} cores: {coll} matrix in {elapsed:.1f} s")
            assert elapsed < OVERSUBSCRIBED_BOUND_S, f"{coll}: {elapsed:.1f} s"
    finally:
        pool.close()


# ---------------------------------------------------- isolation and security


def test_two_jobs_on_one_host_do_not_interfere(pool4):
    results = pool4.run(rc.two_jobs, free_port(), free_port(), 600 if LONG else 150)
    assert results == [[]] * 4, results


def test_segments_are_private_and_unguessable(pool4):
    """A segment exists by name only while ranks attach: catch one by having
    rank 0 wait for a peer that cannot attach (4 s: the checks below take
    milliseconds once the segment shows)."""
    before = rc.shm_entries()
    result = {}
    t = threading.Thread(target=lambda: result.update(
        out=pool4.run(rc.creator_waits, 2, pool4.new_name("private"), 4.0, world=2)))
    t.start()
    found, deadline = set(), time.monotonic() + 30
    while not found and time.monotonic() < deadline:
        found = rc.shm_entries() - before
        time.sleep(0.05)
    assert len(found) == 1, found
    seg = found.pop()
    assert re.fullmatch(r"pycomm\.[0-9a-f]{32}\.0", seg), seg  # 128 random bits
    st_ = os.stat("/dev/shm/" + seg)
    assert stat.S_IMODE(st_.st_mode) == 0o600, oct(st_.st_mode)
    assert st_.st_uid == os.getuid()
    if os.getuid() == 0:
        assert rc.open_as_other_user("/dev/shm/" + seg) == "denied"
    t.join()
    assert "only 1 of 2 local ranks joined" in result["out"][0], result
    assert "wrong size" in result["out"][1], result
    assert seg not in rc.shm_entries(), "a job that failed to start left its segment"


def test_other_uid_cannot_open_a_segment():
    if os.getuid() != 0:
        pytest.skip("needs root to act as a second user")
    path = "/dev/shm/pycomm.uidcheck"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        assert rc.open_as_other_user(path) == "denied"
    finally:
        os.close(fd)
        os.unlink(path)


def test_stale_segment_is_never_attached(pool4):
    name = "/pycomm." + "e" * 32 + ".0"
    try:
        out = pool4.run(rc.stale_segment, name, "a" * 32, world=1)[0]
        assert out["left behind"] == "True", out
        assert "cannot create" in out["create again"] and "exists" in out["create again"], out
        assert "does not belong to this job" in out["attach, other token"], out
    finally:
        if os.path.exists("/dev/shm" + name):
            os.unlink("/dev/shm" + name)


# --------------------------------------------------------------- elastic


def test_elastic_restart_reinitialises_cleanly():
    before = rc.shm_entries()
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        "--max-restarts", "1", "--monitor-interval", "0.2", os.path.join(HERE, "elastic_script.py")],
                       env=env, capture_output=True, text=True, timeout=240, cwd=HERE)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert sorted(re.findall(r"OK rank \d+ attempt \d+", p.stdout)) == [f"OK rank {r} attempt 1" for r in range(3)]
    assert not rc.shm_entries() - before
