"""The chaos soak (benchmarks/chaos.py) at CI's size: failures (kill -9 and
SIGSTOP at random moments, inside recoveries and joins too, a replacement for
each) during one FaultTolerantDDP training with the int8 hook (6 failures)
and one PP x DP training, replicas of a 2-stage pipeline (4 failures);
every step's parameters and optimizer state identical on every rank (every
replica of a stage), accuracy within a point of the training without
failures, no crash, hang or leak. PYCOMM_LONG=1: 200 failures on 8 ranks
(DDP), 50 (PP x DP)."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = os.environ.get("PYCOMM_LONG") == "1"
SIZES = {
    "ddp": (["--failures", "200", "--world", "8", "--gap", "1.5"] if LONG else ["--failures", "6", "--gap", "0.3"]),
    "pipeline": (["--failures", "50", "--world", "8", "--gap", "1.0"] if LONG else
                 ["--failures", "4", "--gap", "0.5"]),
}


@pytest.mark.parametrize("job", ["ddp", "pipeline"])
def test_chaos_soak(tmp_path, job):
    out = tmp_path / "chaos.json"
    size = SIZES[job]
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "chaos.py"), "--job", job, *size,
                               "--json", str(out)], capture_output=True, text=True, timeout=5400 if LONG else 600,
                              env=dict(os.environ, PYTHONPATH=ROOT))
    except subprocess.TimeoutExpired as e:  # the driver's own hang detector should have fired first
        pytest.fail(f"the soak ran past its limit:\n{(e.stdout or b'')[-3000:]!r}\n{(e.stderr or b'')[-6000:]!r}")
    summary = [line for line in proc.stdout.splitlines() if line.startswith("chaos soak")]
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    soak, base = res["soak"], res["base"]
    assert soak["failures"] == int(size[1]), summary
    assert soak["wrong_steps"] == 0 and soak["checked_steps"] == soak["steps"], (summary, soak["wrong"])
    assert soak["crashes"] == {} and soak["hung"] == [] and soak["leaked"] == [], (summary, soak["crashes"])
    assert soak["not_fenced"] == [], summary
    assert len(soak["acc"]) == 1 and soak["acc"][0] >= base["acc"][0] - 1.0, (summary, soak["acc"], base["acc"])
    # Every rank's membership changes, those of ranks killed later too: a
    # failure of a member shrinks the job, and its replacement is admitted.
    assert soak["changes"]["shrink"] >= 1 and soak["changes"]["admit"] >= 1, (summary, soak["changes"])
    assert res["ok"] and proc.returncode == 0, summary


def test_chaos_driver_ends_and_leaves_nothing_when_the_job_cannot_go_on(tmp_path):
    """Failures every ~0.1 s outrun a PP x DP job's recoveries: at times there
    is no one to hit (the driver once crashed choosing from nobody, and its
    orphaned ranks kept the caller waiting on their pipes until its 600 s
    limit), and at last no whole replica survives, so nothing happens any
    more. The driver must end on its own with what it saw (states, crash
    reasons, the ranks' Python stacks), and leave no process behind."""
    out = tmp_path / "chaos.json"
    marker = str(out)  # forked ranks carry the driver's command line
    try:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "chaos.py"), "--job", "pipeline",
                               "--failures", "6", "--gap", "0.1", "--stall-s", "5", "--json", marker],
                              capture_output=True, text=True, timeout=180, env=dict(os.environ, PYTHONPATH=ROOT))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the driver or its ranks outlived 180 s:\n{(e.stderr or b'')[-3000:]!r}")
    left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    assert not left, f"processes left behind: {left}"
    if proc.returncode != 0:  # the usual end: the job cannot go on, said with what the driver saw
        assert "(a hang?)" in proc.stderr and "states:" in proc.stderr, proc.stderr[-3000:]
        assert "IndexError" not in proc.stderr, proc.stderr[-3000:]
