"""``PYCOMM_DEBUG``: what ``NCCL_DEBUG`` is to NCCL.

pycomm reports through the ``logging`` logger ``"pycomm"`` (the hooks' policy,
the tuner's choices, recovery). ``PYCOMM_DEBUG=INFO`` (or ``WARN``, ``DEBUG``)
turns that logger on without touching the script's own logging, with a line
per record that says where it comes from, as NCCL's do::

    host:pid:thread [rank] LEVEL message

and ``PYCOMM_DEBUG_FILE`` sends them to a file instead of stderr (``%h`` the
host, ``%p`` the process id, ``%r`` the rank, as in ``NCCL_DEBUG_FILE``). At
``INFO`` every communicator says what it was built as (ranks, hosts,
transport, sizes, timeouts), and rank 0 which algorithm ``auto`` picks for
each collective and size.

Example (shell)::

    PYCOMM_DEBUG=INFO torchrun --nproc-per-node 4 train.py
    PYCOMM_DEBUG=INFO PYCOMM_DEBUG_FILE=/tmp/pycomm.%h.%p.log torchrun ...
"""
from __future__ import annotations

import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, List, Optional, Sequence

import torch

from ._loader import load_core
from ._version import __version__
from ._env import format_size as _size

if TYPE_CHECKING:  # only for annotations: no import cycle with the communicator
    from .communicator import Communicator

logger = logging.getLogger("pycomm")

LEVELS = {"WARN": logging.WARNING, "WARNING": logging.WARNING, "INFO": logging.INFO,
          "DEBUG": logging.DEBUG, "TRACE": logging.DEBUG}
# Sizes the tuner's choices are listed for (per rank's buffer): 1 KiB to 1 GiB.
_SIZES = [1 << s for s in range(10, 31)]


class _Handler(logging.StreamHandler):
    """The handler PYCOMM_DEBUG installed (its class marks it, so that a
    second call does not add another)."""


def configure_from_env(environ: Optional[dict] = None) -> Optional[logging.Handler]:
    """Turn the ``pycomm`` logger on as ``PYCOMM_DEBUG`` / ``PYCOMM_DEBUG_FILE`` say;
    returns the handler it installed (None when the variable is unset or one
    is installed already). ``import pycomm`` calls it.

    Example::

        os.environ["PYCOMM_DEBUG"] = "INFO"; pycomm._debug.configure_from_env()
    """
    env = os.environ if environ is None else environ
    value = env.get("PYCOMM_DEBUG", "").strip().upper()
    if not value:
        return None
    level = LEVELS.get(value)
    if level is None:
        logger.warning("pycomm: PYCOMM_DEBUG=%r is not one of %s; ignored", value, ", ".join(LEVELS))
        return None
    logger.setLevel(level)
    if any(isinstance(h, _Handler) for h in logger.handlers):
        return None
    host, pid, rank = socket.gethostname(), os.getpid(), env.get("RANK", "?")
    path = env.get("PYCOMM_DEBUG_FILE", "").strip()
    if path:
        path = path.replace("%h", host).replace("%p", str(pid)).replace("%r", str(rank))
        stream = open(path, "a", buffering=1)
    else:
        stream = sys.stderr
    handler = _Handler(stream)
    handler.setFormatter(logging.Formatter(f"{host}:{pid}:%(threadName)s [{rank}] %(levelname)s %(message)s"))
    logger.addHandler(handler)
    # The records go to this handler only: a script's own root handler would
    # print each of them a second time.
    logger.propagate = False
    return handler


def describe(comm: "Communicator", collectives: Sequence[str]) -> List[str]:
    """What ``PYCOMM_DEBUG=INFO`` says about a communicator: how it was built, and
    (rank 0) which algorithm ``auto`` picks per collective and size.

    Example::

        for line in pycomm._debug.describe(comm, ["all_reduce"]): print(line)
    """
    cores = f"bound to CPUs {comm.cpus}" if comm.cpus else "not bound"
    lines = [f"pycomm: communicator {comm.name!r} epoch {comm.epoch}: rank {comm.rank} of {comm.world_size} "
             f"(host {comm.host} of {comm.num_hosts}, local rank {comm.local_rank} of {comm.local_size}), "
             f"transport {comm.transport}, round {_size(comm.round_bytes)}B, timeout {comm.timeout:g} s, "
             f"heartbeat {comm.heartbeat_timeout:g} s, cores {cores}; pycomm {__version__}, torch {torch.__version__}, "
             f"{'CUDA' if getattr(load_core(), 'has_cuda', False) else 'CPU'} build"]
    if comm.rank == 0:
        for coll in collectives:
            lines.append(f"pycomm: auto for {coll}: " + ", ".join(
                f"{_size(lo)}B-{_size(hi)}B {name}" if lo != hi else f"{_size(lo)}B {name}"
                for lo, hi, name in _ranges(comm, coll)))
    return lines


def log_communicator(comm: "Communicator", collectives: Sequence[str]) -> None:
    """Log :func:`describe`'s lines at INFO (nothing is computed when INFO is off)."""
    if logger.isEnabledFor(logging.INFO):
        for line in describe(comm, collectives):
            logger.info("%s", line)


def _ranges(comm: "Communicator", coll: str):
    """(first size, last size, algorithm) runs of the same choice over _SIZES."""
    runs: List[list] = []
    for size in _SIZES:
        name = comm.resolve_algorithm(coll, "auto", size)
        if runs and runs[-1][2] == name:
            runs[-1][1] = size
        else:
            runs.append([size, size, name])
    return [tuple(r) for r in runs]
