"""Shrinking a communicator to its survivors (pycomm.elastic): kill -9 of a
random rank mid-stream (the survivors agree, renumber and go on with correct
results), a shrink on purpose (the excluded rank is fenced out, the old
communicator is fenced everywhere), shrinking to one rank, and a Store that
died (a clear error)."""
import os
import re
import time

import pytest

import elastic_cases as ec
import reliability_cases as rc

LONG = os.environ.get("PYCOMM_LONG") == "1"


@pytest.fixture(scope="module")
def zygote():
    z = rc.Zygote()
    yield z
    z.close()


def test_survivors_shrink_after_kill_9_and_go_on(zygote):
    trials = 12 if LONG else 4
    recoveries = []
    for i in range(trials):
        world = (3, 4)[i % 2]
        res = zygote.run(ec.kill_and_shrink, world, 700 + i, timeout=180)
        victim = res["victim"]
        where = f"trial {i} (world {world}, rank {victim} killed)"
        assert res["hung"] == 0, where
        assert res["leaked"] == [], f"{where}: left {res['leaked']}"
        survivors = [r for r in range(world) if r != victim]
        for r, rep in res["reports"].items():
            assert rep is not None, f"{where}: rank {r} never reported"
            assert rep["wrong"] == 0, (where, r, rep)
            assert rep["shrinks"] == 1, (where, r, rep)
            assert rep["members"] == survivors and rep["world"] == world - 1 and rep["epoch"] == 1, (where, r, rep)
            assert f"rank {victim}" in rep["error"], (where, r, rep["error"])
            recoveries.append(rep["recovery_s"])
    # The figure is a benchmark's (RESULTS.md); this only catches a shrink
    # that waits out a timeout instead of acting on what it knows.
    assert max(recoveries) < 5.0, recoveries


def test_shrink_on_purpose_fences_the_excluded_rank(zygote):
    from harness import RankPool

    pool = RankPool(3)
    try:
        out = pool.run(ec.exclude_on_purpose, 3, pool.new_name("excl"), [1])
        assert "fenced out" in out[1]["error"] and "excluded" in out[1]["error"], out[1]
        for r in (0, 2):
            assert out[r]["world"] == 2 and out[r]["members"] == [0, 2] and out[r]["ok"], out[r]
            assert out[r]["rank"] == (0 if r == 0 else 1) and out[r]["epoch"] == 1, out[r]
        for o in out:
            assert "replaced by a shrink" in o["old"], o
        # Down to one rank.
        out = pool.run(ec.exclude_on_purpose, 2, pool.new_name("solo"), [1], world=2)
        assert out[0]["world"] == 1 and out[0]["members"] == [0] and out[0]["ok"], out[0]
        assert "fenced out" in out[1]["error"], out[1]
    finally:
        pool.close()


def test_shrink_says_when_the_store_is_gone(zygote):
    out = zygote.run(ec.store_dies, 2, timeout=120)
    for msg in out:
        assert msg.startswith("CommError") and "Store cannot be reached" in msg, out


@pytest.mark.parametrize("layout", ["one host", "2x2"])
def test_frozen_rank_is_declared_failed_by_heartbeat_then_fenced(zygote, layout):
    """SIGSTOP: detected within the heartbeat bound (1 s here), not at the
    60 s timeout; the survivors shrink and go on; SIGCONT: the frozen rank's
    next call raises and its shrink says it was fenced out. On 2 simulated
    hosts the frozen rank is rank 3: rank 2 sees it stop beating in shared
    memory, ranks 0 and 1 through the store (no shared memory between
    hosts)."""
    world, kwargs = (3, {}) if layout == "one host" else (4, dict(local_size=2))
    res = zygote.run(ec.freeze_and_shrink, world, 1.0, kwargs, timeout=180)
    frozen = res["frozen"]
    assert res["hung"] == 0
    for r in range(world - 1):
        rep = res["reports"][r]
        assert rep and rep["wrong"] == 0 and rep["members"] == list(range(world - 1)) and rep["epoch"] == 1, rep
        assert rep["blamed"] == frozen and rep["failure"] == "silent", rep
        assert rep["heartbeat"] == 1.0, rep  # the shrunk communicator keeps the bound
        assert "no heartbeat" in rep["error"], rep
        # The bound plus a liveness period and a sleep slice.
        assert 0.9 <= rep["detected_after_s"] <= 3.0, rep
    rep = res["reports"][frozen]
    assert rep and "fenced out" in rep.get("fenced", ""), rep


def test_busy_rank_is_never_declared_failed(zygote):
    """A rank that computes for 6 heartbeat bounds (holding the GIL), on the
    other of 2 simulated hosts, while its peers wait for it: it keeps beating
    (in shared memory and on the Store) and nobody declares it failed."""
    res = zygote.run(ec.busy_rank_keeps_beating, 4, 0.5, 3.0, dict(local_size=2), timeout=120)
    assert res["hung"] == 0
    for r, rep in res["reports"].items():
        assert rep and "error" not in rep and rep["wrong"] == 0 and rep["gone"] == [], (r, rep)
        if r != 3:
            assert rep["wait1"] >= 2.5, (r, rep)  # it did wait for the busy rank


def test_second_death_during_a_shrink(zygote):
    res = zygote.run(ec.second_death_during_shrink, 4, timeout=180)
    assert res["hung"] == 0
    for r in (2, 3):
        rep = res["reports"][r]
        assert rep and rep["wrong"] == 0, rep
        # One attempt failed on every survivor, with a message saying to retry; the next one held.
        assert rep["attempts"] == 2 and "call shrink() again" in rep["retry_error"], rep
        assert rep["failed_attempt_s"] < 10, rep  # not the 30 s bootstrap timeout
        assert rep["members"] == [2, 3] and rep["epoch"] == 1, rep


@pytest.mark.parametrize("victim", [1, 2])
def test_shrink_on_simulated_hosts(zygote, victim):
    """2 hosts x 2 ranks: the victim shares a host with rank 0 (victim 1) or
    not (victim 2); the survivors' new communicator keeps the hosts."""
    res = zygote.run(ec.kill_and_shrink, 4, 0, 10, dict(local_size=2), victim, timeout=180)
    assert res["hung"] == 0 and res["leaked"] == [], res
    survivors = [r for r in range(4) if r != victim]
    for r, rep in res["reports"].items():
        assert rep and rep["wrong"] == 0 and rep["members"] == survivors and rep["world"] == 3, (r, rep)


@pytest.mark.parametrize("fate", ["killed while waiting", "killed before its record", "dies", "stops",
                                  "member dies", "gives up"])
def test_newcomer_that_fails_on_its_way_in(zygote, fate):
    """A replacement killed while it waits for admission is skipped, also
    one killed between taking its ticket and publishing its process record
    (1 s grace, not the 30 s bootstrap timeout); one that dies or freezes
    once admitted fails the members' admit as soon as it is seen (1 s
    heartbeat), and the members shrink back to themselves. So does a member
    killed after the admission was agreed, before its new bootstrap (the
    others knew its process record from the old communicator; before, they
    waited 30 s for it). One whose join timed out, alive, withdrew its
    ticket: the admit takes nobody (before, the members admitted it and
    waited 30 s for it, as in the PP x DP chaos soak)."""
    res = zygote.run(ec.newcomer_fails, 3, fate, timeout=180)
    assert res["hung"] == 0, res
    for r, rep in res["reports"].items():
        assert rep and rep["ok"], (r, rep)
        if fate.startswith("killed"):
            assert "error" not in rep and rep["world"] == 4 and rep["seconds"] < 10, (r, rep)
        elif fate == "gives up":  # its ticket was withdrawn: nobody to wait for (30 s before)
            assert "error" not in rep and rep["world"] == 3 and rep["seconds"] < 10, (r, rep)
        elif fate == "member dies":
            assert rep["world"] == 2 and rep["parents"] == [0, 1], (r, rep)
            assert rep["failed_s"] < 10, (r, rep)  # not the 30 s timeout
        else:
            assert rep["world"] == 3 and rep["parents"] == [0, 1, 2], (r, rep)
            assert rep["failed_s"] < (10 if fate == "dies" else 12), (r, rep)
            assert "newcomer" in rep["error"], (r, rep)
    if fate.startswith("killed"):
        assert res["newcomer"] == dict(world=4, rank=3, ok=True), res
    if fate == "gives up":
        assert res["gave_up"] == dict(gave_up=True), res
    if fate == "member dies":  # the first to see it names it; the others follow its verdict
        assert any("rank 2 " in rep["error"] and "died" in rep["error"] for rep in res["reports"].values()), res


def test_a_newcomer_passed_over_raises_in_join_at_once():
    """Members that took a newcomer for dead (its record came too late, or
    it was frozen) tell it so: its join raises instead of waiting for an
    admission that never comes."""
    import datetime
    import json

    import pycomm
    import torch.distributed as dist
    from pycomm.elastic import membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    js = membership._job_store(store, "passed")
    js.set("admitted/1", json.dumps(dict(passed_over=True)))  # what admit() writes for ticket 1
    t0 = time.monotonic()
    with pytest.raises(pycomm.CommError, match="passed this process over \\(ticket 1\\).*join again"):
        membership.join(store, "passed", timeout=60)
    assert time.monotonic() - t0 < 5


def test_a_newcomer_whose_ticket_was_claimed_waits_on_past_its_timeout():
    """A newcomer whose join times out withdraws its ticket, unless members
    claimed it already (an admission agreed or under way, which waits for
    it): then it waits on for its admission (up to its timeout once more)
    instead of leaving the members waiting for it."""
    import datetime
    import json
    import threading

    import pycomm
    import torch.distributed as dist
    from pycomm.elastic import membership

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=10))
    js = membership._job_store(store, "claimed")
    assert membership._claim(js, 1, "job/0") == "job/0"  # what admit() does first for ticket 1
    # The admission comes after the newcomer's own timeout (here: passed over, so that join raises).
    # (From a client of its own: one client's calls wait for each other.)
    member = membership._job_store(dist.TCPStore("127.0.0.1", store.port, is_master=False), "claimed")
    later = threading.Timer(0.8, lambda: member.set("admitted/1", json.dumps(dict(passed_over=True))))
    later.start()
    t0 = time.monotonic()
    with pytest.raises(pycomm.CommError, match="passed this process over"):
        membership.join(store, "claimed", timeout=0.5)
    assert time.monotonic() - t0 >= 0.75
    later.join()
    # Unclaimed: the newcomer withdraws, and an admit that comes later cannot claim it.
    with pytest.raises(pycomm.CommError, match="did not admit this process \\(ticket 2\\) within 0.5 s"):
        membership.join(store, "claimed", timeout=0.5)
    assert membership._claim(js, 2, "job/1") == membership._WITHDRAWN


def test_process_records_tell_dead_stopped_and_remote_processes_apart():
    """What a bootstrap's watch reads: a running process, one stopped
    (SIGSTOP), a dead one (a zombie, then reaped, then its pid reused by
    nobody we know), another host's, and garbage."""
    import json
    import signal
    import subprocess
    import sys

    from pycomm import bootstrap

    assert bootstrap.process_gone(bootstrap.process_record()) is None
    child = subprocess.Popen([sys.executable, "-c", "import sys; from pycomm import bootstrap; "
                              "print(bootstrap.process_record(), flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    rec = child.stdout.readline().strip()
    try:
        assert json.loads(rec)["pid"] == child.pid and bootstrap.process_gone(rec) is None

        def becomes(what):  # signals are delivered asynchronously
            deadline = time.monotonic() + 10
            while bootstrap.process_gone(rec) != what and time.monotonic() < deadline:
                time.sleep(0.01)
            return bootstrap.process_gone(rec) == what

        os.kill(child.pid, signal.SIGSTOP)
        assert becomes("stopped")
        os.kill(child.pid, signal.SIGKILL)
        assert becomes("died")  # a zombie until reaped
    finally:
        child.kill()
        child.wait()
    assert bootstrap.process_gone(rec) == "died"  # reaped: no such process
    other = dict(json.loads(bootstrap.process_record()), host="another-host|boot|ns")
    assert bootstrap.process_gone(json.dumps(other)) is None  # cannot be seen from here: not judged
    reused = dict(json.loads(bootstrap.process_record()), start="1")
    assert bootstrap.process_gone(json.dumps(reused)) == "died"  # the pid now runs another process
    for garbage in ("", "1", "null", "{}", "not json"):
        assert bootstrap.process_gone(garbage) is None


def test_creator_that_dies_before_saying_so_leaves_no_segment(zygote):
    """The host's first rank creates the shared segment and dies before it
    says so on the store: the others give up within milliseconds, naming it,
    and remove the segment's name, which no rank will ever map (the 200-failure
    chaos soak left one in /dev/shm this way)."""
    res = zygote.run(ec.creator_dies_before_saying_so, 3, timeout=120)
    assert res["hung"] == 0
    assert len(res["made"]) == 1, res  # the segment existed when the creator died
    for r, rep in res["reports"].items():
        assert rep and "error" in rep and "rank 0 " in rep["error"] and "died" in rep["error"], (r, rep)
        assert rep["seconds"] < 10, (r, rep)  # not the 30 s timeout
    assert res["left"] == [], res


def test_death_before_attaching_the_segment_ends_the_bootstrap(zygote):
    """The segment's creator and the ranks that attached wait for every local
    rank to map it; one that died first is seen within milliseconds."""
    res = zygote.run(ec.death_before_attaching, 3, timeout=120)
    assert res["hung"] == 0
    reps = res["reports"]
    for r, rep in reps.items():
        # Rank 2, or a rank that gave up before this one and left (dead too by then).
        assert rep and "error" in rep and "died" in rep["error"], (r, rep)
        assert rep["seconds"] < 10, (r, rep)  # not the 30 s timeout
    assert any("rank 2 " in rep["error"] for rep in reps.values()), reps  # the first to see it names it


def test_spares_beyond_max_world_size_wait_for_room(zygote):
    """torchrun's --nnodes=MIN:MAX: newcomers beyond max_world_size wait in
    join as spares, in ticket order, and come in once a shrink made room;
    an admit without room keeps the communicator. (Without the bound, the
    DDP chaos soak's replacements for frozen ranks that came back trained
    beside them: 8 ranks grew to 25.)"""
    res = zygote.run(ec.spares_wait_for_room, 3, timeout=180)
    assert res["hung"] == 0, res
    reps = res["reports"]
    for r in (0, 2):  # (world, rank, epoch) after each stage: admit, admit (no room), shrink, admit, sum
        rep = reps[f"member {r}"]
        assert rep["worlds"] == [(4, r, 1), (4, r, 1), (3, r // 2, 2), (4, r // 2, 3), (4, r // 2, 3)], rep
        assert rep["kept"] and rep["ok"], rep
    assert reps["member 1"] == dict(worlds=[(4, 1, 1), (4, 1, 1)], kept=True, fenced=True), reps["member 1"]
    first = reps["ticket 1"]
    assert first["joined"] == (4, 3, 1) and first["kept"] and first["ok"], first
    assert first["worlds"] == [(4, 3, 1), (3, 2, 2), (4, 2, 3), (4, 2, 3)], first
    second = reps["ticket 2"]
    assert second["joined"] == (4, 3, 3) and second["worlds"] == [(4, 3, 3)] and second["ok"], second
    assert not res["third_admitted"], res
    # Every rank names the last communicator alike, by job, epoch and a digest of its lineage (bounded:
    # the lineage spelled out grew with every change of membership).
    names = {rep["name"] for key, rep in reps.items() if key != "member 1"}
    assert len(names) == 1 and re.fullmatch(r"spares@3\.[0-9a-f]{12}", names.pop()), names


def test_max_world_size_is_checked():
    from pycomm.elastic import admit

    with pytest.raises(ValueError, match="max_world_size must be >= 1"):
        admit(None, max_world_size=0)
