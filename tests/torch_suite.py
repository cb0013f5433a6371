"""Runs PyTorch's own distributed test base against one c10d backend.

The torch wheel ships the tests every c10d backend is held to
(``torch/testing/_internal/distributed/distributed_test.py``,
``DistributedTest._DistTestBase``). This script runs a selection of them, one
test at a time with its ranks forked from this process, and prints one JSON
line per test: ``{"test", "status", "seconds", "why"}`` with status ``pass``,
``fail`` or ``skip``.

The suite's import-time skip decorators are evaluated as for Gloo (``--gate``),
so pycomm runs exactly the tests Gloo runs (upstream gates some on the
literal name "gloo"), while every group the tests create is a pycomm group.
``--gate mpi`` runs the CPU all_to_all tests, which upstream enables for MPI
only, on either backend.
A few test bodies branch on the backend's name to build a CPU model
(``ALIASED``): those see "gloo" in their body, and the groups they create
under that name are still created on pycomm.

Used by ``tests/test_torch_suite.py`` (a slice, world size 2, both backends)
and ``benchmarks/torch_suite.py`` (everything, worlds 2, 3, 4 and 8)::

    python tests/torch_suite.py --backend pycomm --world-size 2 -k broadcast
    python tests/torch_suite.py --backend gloo --list
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
import unittest
from typing import Dict, Iterable, List, Optional

#: Tests that torch itself runs only on Gloo: ``dist.monitored_barrier``
#: raises for any other backend before a backend sees the call.
GLOO_ONLY = re.compile(r"test_monitored_barrier.*")
#: Tests whose bodies pick their model by the backend's name.
ALIASED = re.compile(r"test_accumulate_gradients_no_sync.*")
#: Never selected: GPU variants (they only skip on a CPU machine).
EXCLUDED = re.compile(r".*(cuda|nccl|gpu).*")

_GATE = "gloo"


def _import_suite(backend: str, world_size: int, test_timeout: int, gate: str):
    """Imports the test base with its decorators seeing `gate`; returns the test class."""
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ.setdefault("DISTRIBUTED_TESTS_DEFAULT_TIMEOUT", str(test_timeout))
    os.environ["BACKEND"] = gate
    import torch
    import torch.distributed as dist

    if backend != "gloo":
        import pycomm  # noqa: F401  (registers the backend)
    from torch.testing._internal import common_distributed
    from torch.testing._internal.common_distributed import DistTestCases

    # A third-party backend declares what it supports before the suite is
    # imported, as torch's own plugin backends do.
    for feature in ("ddp", "subgroup", "plugin"):
        DistTestCases.backend_feature[feature].add(backend)
    # Upstream lets a few tests run for up to 500 s: keep every test bounded.
    for name, limit in list(common_distributed.TIMEOUT_OVERRIDE.items()):
        common_distributed.TIMEOUT_OVERRIDE[name] = min(limit, 2 * test_timeout)
    import torch.testing._internal.distributed.distributed_test as suite

    suite.BACKEND = backend
    os.environ["BACKEND"] = backend

    class Suite(suite.TestDistBackend, suite.DistributedTest._DistTestBase):
        def setUp(self) -> None:
            super().setUp()
            # Forked ranks inherit the imported modules: ~0.3 s a test
            # instead of seconds for each spawned rank to import torch.
            self._start_processes(torch.multiprocessing.get_context("fork").Process)

    return Suite, suite, dist


def _alias(suite, dist, backend: str):
    """Test bodies see "gloo"; groups created under that name run on `backend`."""
    init, new_group = dist.init_process_group, dist.new_group

    def swap(kwargs):
        if str(kwargs.get("backend", "")).lower() == _GATE:
            kwargs["backend"] = backend
        return kwargs

    dist.init_process_group = lambda *a, **kw: init(*a, **swap(kw))
    dist.new_group = lambda *a, **kw: new_group(*a, **swap(kw))
    suite.BACKEND = _GATE
    os.environ["BACKEND"] = _GATE


class _Outcome(unittest.TestResult):
    def __init__(self) -> None:
        super().__init__()
        self.status, self.why = "fail", "did not run"

    def addSuccess(self, test) -> None:  # noqa: N802 - unittest's names
        self.status, self.why = "pass", ""

    def addSkip(self, test, reason) -> None:  # noqa: N802
        self.status, self.why = "skip", str(reason).splitlines()[0][:200] if reason else ""

    def addExpectedFailure(self, test, err) -> None:  # noqa: N802
        self.status, self.why = "pass", "expected failure"

    def addUnexpectedSuccess(self, test) -> None:  # noqa: N802
        self.status, self.why = "fail", "unexpected success"

    def _failed(self, err) -> None:
        text = "".join(traceback.format_exception(*err))
        lines = [l.strip() for l in text.splitlines() if l.strip()]
        errors = [l for l in lines if re.match(r"^[\w.]*(Error|Exception)\b", l)]
        self.status, self.why = "fail", (errors[-1] if errors else lines[-1] if lines else "")[:300]

    def addFailure(self, test, err) -> None:  # noqa: N802
        self._failed(err)

    def addError(self, test, err) -> None:  # noqa: N802
        self._failed(err)


def select(names: Iterable[str], patterns: List[str]) -> List[str]:
    """Test names matching every regex of `patterns` (search), GPU variants left out."""
    out = [n for n in names if not EXCLUDED.fullmatch(n)]
    for p in patterns:
        out = [n for n in out if re.search(p, n)]
    return sorted(out)


def run(backend: str, world_size: int, patterns: List[str], test_timeout: int = 120,
        listing: bool = False, gate: str = _GATE) -> List[Dict[str, object]]:
    """Runs the selected tests; one record per test (also printed as a JSON line)."""
    Suite, suite, dist = _import_suite(backend, world_size, test_timeout, gate)
    names = select((n for n in dir(Suite) if n.startswith("test_")), patterns)
    # Aliasing is for the rest of the process: those tests go last.
    names = [n for n in names if not ALIASED.fullmatch(n)] + [n for n in names if ALIASED.fullmatch(n)]
    records = []
    # The ranks' output goes to a log file, the records to our stdout.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    log_path = os.environ.get("TORCH_SUITE_LOG", os.devnull)
    aliased = False
    for name in names:
        if listing:
            out.write(name + "\n")
            continue
        if backend != "gloo" and gate == _GATE and ALIASED.fullmatch(name) and not aliased:
            _alias(suite, dist, backend)
            aliased = True
        t0 = time.time()
        outcome = _Outcome()
        with open(log_path, "a") as log:
            saved = os.dup(1), os.dup(2)
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            try:
                Suite(name).run(outcome)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
        rec = {"test": name, "status": outcome.status, "seconds": round(time.time() - t0, 2), "why": outcome.why}
        records.append(rec)
        out.write(json.dumps(rec) + "\n")
    return records


def launch(backend: str, world_size: int, args: List[str], test_timeout: int = 120,
           log: str = os.devnull, timeout: Optional[float] = None) -> Dict[str, Dict[str, object]]:
    """Runs this script in a fresh process (its ranks fork from that one, not
    from the caller) with `args`; returns its records by test name. Raises
    RuntimeError, with the process's stderr, if it fails."""
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1", TORCH_SUITE_LOG=log)
    cmd = [sys.executable, os.path.abspath(__file__), "--backend", backend, "--world-size", str(world_size),
           "--timeout", str(test_timeout), *args]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout,
                       cwd=os.path.dirname(log) if log != os.devnull else None)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return {r["test"]: r for r in map(json.loads, p.stdout.splitlines())}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="pycomm", choices=["gloo", "pycomm"])
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("-k", action="append", default=[], help="regex on test names (repeatable: all must match)")
    ap.add_argument("--tests", help="file of test-name regexes, one per line (any may match)")
    ap.add_argument("--timeout", type=int, default=120, help="seconds per test before its ranks are killed")
    ap.add_argument("--list", action="store_true", help="print the selected names only")
    ap.add_argument("--gate", default=_GATE, choices=["gloo", "mpi"],
                    help="the name the suite's skip decorators see: mpi enables the CPU all_to_all tests, which "
                         "upstream runs on MPI only")
    args = ap.parse_args(argv)
    patterns = list(args.k)
    if args.tests:
        with open(args.tests) as f:
            alternatives = [l.split("#")[0].strip() for l in f if l.split("#")[0].strip()]
        patterns.append("^(" + "|".join(alternatives) + ")$")
    run(args.backend, args.world_size, patterns, args.timeout, args.list, args.gate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
