"""Runs the examples of README.md and docs/ (tests/test_docs.py collects
them): inside a harness worker, as rank ``rank`` of a job that torchrun
would have started.

Each example sees what torchrun gives a script (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so
``dist.init_process_group("gloo")`` works as written. A ``setup=NAME``
example first runs ``SETUPS[NAME]``: the context a page's fragment assumes
(a default group, a communicator, a model), kept here, visible, instead of
repeated on every page.
"""
from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator

SETUPS: Dict[str, str] = {
    # A job of WORLD_SIZE ranks on the CPU, as under torchrun.
    "group": """
import torch, torch.distributed as dist, pycomm
dist.init_process_group("gloo")
rank, world_size = dist.get_rank(), dist.get_world_size()
""",
    "comm": """
import torch, torch.distributed as dist, pycomm
dist.init_process_group("gloo")
comm = pycomm.Communicator()
grad = torch.randn(1 << 16)
""",
    # A small DDP model and its data: 8 steps of a linear classifier.
    "ddp": """
import torch, torch.distributed as dist, pycomm
from torch.nn.parallel import DistributedDataParallel
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
ddp = DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
loss_fn = torch.nn.functional.cross_entropy
g = torch.Generator().manual_seed(dist.get_rank())
data = [(torch.randn(16, 32, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(8)]
x, y = data[0]
""",
}


#: The default group's timeout when an example gives none: an example that
#: fails on one rank must not leave its peers in a collective for torch's
#: default 30 minutes.
GROUP_TIMEOUT_S = 60


@contextlib.contextmanager
def _bounded_init() -> Iterator[None]:
    import datetime

    import torch.distributed as dist

    original = dist.init_process_group

    def init_process_group(*args, **kwargs):
        kwargs.setdefault("timeout", datetime.timedelta(seconds=GROUP_TIMEOUT_S))
        return original(*args, **kwargs)

    dist.init_process_group = init_process_group
    try:
        yield
    finally:
        dist.init_process_group = original


@contextlib.contextmanager
def _torchrun_env(rank: int, world: int, port: int, extra: Dict[str, str]) -> Iterator[None]:
    saved = dict(os.environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), **extra)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _cleanup(namespace: dict) -> None:
    """What the example left behind, released in the order it depends on.

    The example's objects go before the group does: a DDP model dropped
    after ``destroy_process_group()`` holds the group's last reference, so
    its ``~ProcessGroupGloo`` joins Gloo's threads with the GIL held, while
    one of them may still be releasing the tensors of the example's last
    collective (``dist.all_gather``), which takes the GIL: both wait forever
    (docs/stragglers.md hung so in CI). Dropped while the group is still
    registered, the model's reference is not the last; the group's own
    Python handle then releases it without the GIL."""
    import gc

    import torch.distributed as dist

    import pycomm

    for value in list(namespace.values()):
        if isinstance(value, pycomm.Communicator):
            with contextlib.suppress(Exception):
                value.close()
    namespace.clear()
    gc.collect()  # functions the example defined keep its namespace in a cycle
    pycomm.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()


def _all_done(rank: int, world: int, key: str, timeout_s: float = 30.0) -> None:
    """Waits (bounded) until every rank of the example finished it, through
    the harness's own Store: a rank that tears its process group down while a
    peer still receives the last collective's data leaves that peer waiting
    (a script that exits has the same race; its processes rarely outlive it)."""
    from harness import all_reached

    with contextlib.suppress(Exception):  # a peer that failed: its own error is the report
        all_reached(rank, world, key, timeout_s)


def run_example(rank: int, world: int, code: str, setup: str, env: Dict[str, str], port: int, where: str) -> str:
    """Runs one example on this rank; raises what the example raised."""
    program = "".join(SETUPS[name] for name in setup.split(",") if name) + code
    namespace: dict = {"__name__": "__main__"}
    with _torchrun_env(rank, world, port, env), _bounded_init():
        try:
            exec(compile(program, where, "exec"), namespace)  # noqa: S102 - the docs' own examples
        finally:
            _all_done(rank, world, f"doc-example/{port}/done")
            _cleanup(namespace)
    return "ok"
