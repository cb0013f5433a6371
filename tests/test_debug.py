"""PYCOMM_DEBUG / PYCOMM_DEBUG_FILE: the pycomm logger turned on from the
environment, NCCL_DEBUG style (each case a fresh process: it sets up logging)."""
import logging
import os
import re
import subprocess
import sys

SCRIPT = r"""
import logging, torch, torch.distributed as dist, pycomm
dist.init_process_group("gloo")
logging.basicConfig(level=logging.INFO)          # the script's own root handler
comm = pycomm.Communicator()
if comm.rank == 0:
    for coll in ("all_reduce", "broadcast"):
        print("CHOICE", coll, *(comm.resolve_algorithm(coll, "auto", s) for s in (1 << 10, 1 << 20, 1 << 30)))
comm.close()
"""


def run(env, *args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **env})


def test_info_describes_each_communicator_into_a_file_per_rank(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    r = run({"PYCOMM_DEBUG": "info", "PYCOMM_DEBUG_FILE": str(tmp_path / "pycomm.%h.%p.%r.log")},
            "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script))
    assert r.returncode == 0, r.stdout + r.stderr
    logs = {int(re.search(r"\.(\d)\.log$", p).group(1)): (tmp_path / p).read_text()
            for p in os.listdir(tmp_path) if p.endswith(".log")}
    assert sorted(logs) == [0, 1], os.listdir(tmp_path)
    for rank, text in logs.items():
        line = next(x for x in text.splitlines() if "communicator" in x)
        # host:pid:thread [rank] LEVEL message
        assert re.match(rf"[^:]+:\d+:MainThread \[{rank}\] INFO pycomm: communicator .* rank {rank} of 2 ", line)
        assert "transport shm" in line and "timeout 300 s" in line and "pycomm 0.1.0" in line
    # Rank 0 lists what auto picks, the same the communicator resolves.
    for coll, *choice in (x.split()[1:] for x in r.stdout.splitlines() if x.startswith("CHOICE")):
        listed = next(x for x in logs[0].splitlines() if f"auto for {coll}:" in x)
        assert listed.startswith(logs[0].splitlines()[0].split(" INFO ")[0])
        for name in choice:
            assert name in listed, (name, listed)
    assert "auto for" not in logs[1]
    # The records went to PYCOMM_DEBUG's handler only, not again through the root one.
    assert "communicator" not in r.stderr


def test_unset_leaves_logging_alone_and_a_bad_level_is_named():
    code = "import logging, pycomm; print(logging.getLogger('pycomm').level, len(logging.getLogger('pycomm').handlers))"
    again = code.replace("import logging, pycomm;", "import logging, pycomm; pycomm._debug.configure_from_env();")
    unset = {k: v for k, v in os.environ.items() if not k.startswith("PYCOMM_DEBUG")}
    # Three fresh processes at once (each pays torch's imports).
    procs = [subprocess.Popen([sys.executable, "-c", source], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**unset, "PYTHONUNBUFFERED": "1", **env})
             for source, env in ((code, {}), (code, {"PYCOMM_DEBUG": "loud"}),
                                 # configured at import, then once more: one handler
                                 (again, {"PYCOMM_DEBUG": "DEBUG"}))]
    (out0, err0), (out1, err1), (out2, err2) = (p.communicate(timeout=60) for p in procs)
    assert procs[0].returncode == 0 and out0.split() == ["0", "0"], out0 + err0
    assert procs[1].returncode == 0 and out1.split() == ["0", "0"], out1 + err1
    assert "PYCOMM_DEBUG='LOUD' is not one of WARN" in err1
    assert out2.split() == [str(logging.DEBUG), "1"], out2 + err2
