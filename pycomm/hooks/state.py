"""What every hook state keeps: the iteration count, running statistics and
checkpoints; where its buckets go is :class:`~pycomm.hooks.policy.Router`'s.

Example::

    state = hooks.AllReduceState()
    ddp.register_comm_hook(state, hooks.allreduce_hook)
    state.stats()["bytes_sent"]
"""
import logging
import threading
from typing import Any, Dict, List, Optional

import torch.distributed as dist

from .. import communicator as _communicator
from .. import compression as _compression
from .policy import Group, Router

logger = logging.getLogger("pycomm")


class HookState(Router):
    """What every pycomm hook keeps: where buckets go, the iteration count
    and running statistics.

    Args:
        process_group: the ranks DDP averages over; pass the group you gave
            DDP (default: the default group, served by pycomm's default
            communicator). A :class:`pycomm.Communicator` is accepted too.
        communicator: an existing communicator to share (instead of
            ``process_group``).
        path: ``"auto"`` (the policy in :mod:`pycomm.hooks.policy`), ``"group"``,
            ``"ipc"`` or ``"communicator"``; default: ``PYCOMM_HOOK_PATH`` or
            ``"auto"``.

    The communicator (CPU buckets) and the group and IPC paths (CUDA buckets)
    are set up at the first bucket that needs them, collectively: build
    states on every rank, in the same order.

    A state pickles (``torch.save(state, path)``, as torch's
    ``PowerSGDState``): its settings and :meth:`state_dict`, not its process
    group or communicator, which cannot be pickled. The unpickled state
    serves the default group; set ``state.process_group`` before registering
    it to serve another (or build a state for it and :meth:`load_state_dict`).

    Example::

        state = hooks.AllReduceState()
        ddp.register_comm_hook(state, hooks.allreduce_hook)
        ...
        print(state.stats())   # {'iterations': 100, 'bytes_sent': ..., 'comm_seconds': ...}
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> "HookState":
        self = super().__new__(cls)
        # The settings the state is built with, for pickling: every state's
        # first argument is the process group, which pickles as None, and
        # the communicator is left out (neither can be pickled).
        self._pickled_args = (args[1:], {k: v for k, v in kwargs.items() if k not in ("process_group", "communicator")})
        return self

    def __getstate__(self) -> Dict[str, Any]:
        if self.process_group is not None or self._comm_arg is not None:
            logger.warning("pycomm.hooks: %s is pickled without its process group or communicator; unpickled, "
                           "it serves the default group (set state.process_group before registering it to serve "
                           "another)", type(self).__name__)
        args, kwargs = self._pickled_args
        return {"args": args, "kwargs": kwargs, "state": self.state_dict()}

    def __setstate__(self, pickled: Dict[str, Any]) -> None:
        args, kwargs = pickled["args"], pickled["kwargs"]
        self._pickled_args = (args, kwargs)
        self.__init__(None, *args, **kwargs)  # type: ignore[misc]
        self.load_state_dict(pickled["state"])

    def __init__(self, process_group: Group = None, *,
                 communicator: Optional["_communicator.Communicator"] = None, path: Optional[str] = None) -> None:
        super().__init__(process_group, communicator=communicator, path=path)
        # Iterations DDP synchronized (no_sync() steps are not counted).
        self.iteration = 0
        # Parameters in the order of the first iteration this state saw (DDP's
        # initial bucket layout, the same in every fresh process): how a
        # checkpoint names them (ids of the parameters, and each id's position).
        self._order: List[int] = []
        self._position: Dict[int, int] = {}
        self._order_done = False
        self._lock = threading.Lock()
        self.reset_stats()

    def reset_stats(self) -> None:
        """Zero the running statistics (the iteration count stays)."""
        with self._lock:
            self._totals = {"buckets": 0, "compressed_buckets": 0, "bytes_sent": 0, "bytes_uncompressed": 0,
                            "comm_seconds": 0.0}

    def stats(self) -> Dict[str, float]:
        """Running totals over the buckets completed so far.

        ``bytes_sent`` is what this rank handed to its peers and
        ``bytes_uncompressed`` what a float32 all-reduce would have handed them
        (2(n-1)/n of the bucket), ``compression_ratio`` their quotient and
        ``comm_seconds`` the time pycomm spent on the buckets (compression
        included, queueing excluded; 0 for buckets the group's own
        all-reduce or CUDA IPC carried, which run asynchronously on the GPU).
        """
        with self._lock:
            out: Dict[str, float] = dict(self._totals)
        out["iterations"] = self.iteration
        out["compression_ratio"] = out["bytes_uncompressed"] / out["bytes_sent"] if out["bytes_sent"] else 1.0
        return out

    def state_dict(self) -> Dict[str, Any]:
        """What a checkpoint needs to resume the hook as if never stopped.

        Example::

            torch.save({"model": ddp.state_dict(), "hook": state.state_dict()}, path)
            state.load_state_dict(torch.load(path)["hook"])
        """
        return {"iteration": self.iteration}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.iteration = int(state["iteration"])

    # -------------------------------------------------------------- internals

    def _record(self, seconds: float, sent: int, uncompressed: int, compressed: bool) -> None:
        with self._lock:
            t = self._totals
            t["buckets"] += 1
            t["compressed_buckets"] += int(compressed)
            t["bytes_sent"] += sent
            t["bytes_uncompressed"] += uncompressed
            t["comm_seconds"] += seconds

    def _plain_bytes(self, numel: int, element_size: int) -> int:
        return _compression.plain_allreduce_bytes(numel, element_size, self.world_size)

    def _observe(self, bucket: dist.GradBucket) -> None:
        """Numbers the bucket's parameters, during the first iteration seen."""
        if self._order_done:
            return
        for p in bucket.parameters():
            if id(p) not in self._position:
                self._position[id(p)] = len(self._order)
                self._order.append(id(p))
        self._order_done = bucket.is_last()

    def _end_bucket(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iteration += 1
