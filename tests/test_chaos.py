"""The chaos soak (benchmarks/chaos.py) at CI's size: failures (kill -9 and
SIGSTOP at random moments, inside recoveries and joins too, a replacement for
each) during one FaultTolerantDDP training with the int8 hook (10 failures)
and one PP x DP training, replicas of a 2-stage pipeline (6 failures);
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
    "ddp": (["--failures", "200", "--world", "8", "--gap", "1.5"] if LONG else ["--failures", "10", "--gap", "0.3"]),
    "pipeline": (["--failures", "50", "--world", "8", "--gap", "1.0"] if LONG else
                 ["--failures", "6", "--gap", "0.5"]),
}


@pytest.mark.parametrize("job", ["ddp", "pipeline"])
def test_chaos_soak(tmp_path, job):
    out = tmp_path / "chaos.json"
    size = SIZES[job]
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "chaos.py"), "--job", job, *size,
                           "--json", str(out)], capture_output=True, text=True, timeout=5400 if LONG else 600,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    summary = [line for line in proc.stdout.splitlines() if line.startswith("chaos soak")]
    assert out.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    soak, base = res["soak"], res["base"]
    assert soak["failures"] == int(size[1]), summary
    assert soak["wrong_steps"] == 0 and soak["checked_steps"] == soak["steps"], (summary, soak["wrong"])
    assert soak["crashes"] == {} and soak["hung"] == [] and soak["leaked"] == [], (summary, soak["crashes"])
    assert soak["not_fenced"] == [], summary
    assert len(soak["acc"]) == 1 and soak["acc"][0] >= base["acc"][0] - 1.0, (summary, soak["acc"], base["acc"])
    assert res["ok"] and proc.returncode == 0, summary
