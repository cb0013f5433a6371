"""Training that survives failures: shrinking a communicator to its survivors.

After a peer dies, every survivor's collective raises :class:`pycomm.CommError`
within milliseconds; :func:`shrink` then gives the survivors a new
communicator with renumbered ranks — a fresh segment, a fresh inter-host
group, a fresh sequence — without restarting any process (what NCCL's
``ncclCommShrink`` and torchcomms' revoke/shrink do).

How the survivors agree (through the Store, which must outlive every rank:
torchrun's agent store, or a TCPStore whose host is not a training rank):

1. Each caller first aborts the old communicator: every later call on it,
   by anyone, raises, and a peer still blocked in one of its collectives
   (waiting on this rank, perhaps across hosts) raises at once and comes to
   shrink too.
2. It checks in under the shrink's keys and waits for the ranks it does not
   know to be gone (``exclude``, and :meth:`Communicator.gone_ranks`: a dead
   or frozen local process, the rank a failure blamed as dead) for at most
   ``grace`` seconds; a rank that has not checked in by then is taken as
   failed (a second death during the shrink).
3. The first rank to get there proposes the members it saw (checked in, not
   excluded) with one compare-and-set: exactly one proposal wins, every
   caller reads the same list, so there are never two different groups. A
   rank not in it (excluded, or too late) gets a CommError saying it was
   fenced out.
4. The members build the new communicator under keys of their own. If a
   member dies before it joins, the build fails after ``timeout`` seconds on
   every member with a CommError: call ``shrink`` again on the old
   communicator (each attempt agrees under new keys).

Fencing: keys, segment names and the inter-host group of epoch e+1 are new,
so a rank that was excluded (frozen, partitioned, too late) cannot reach
them; its old communicator is aborted, so its next call raises. Example::

    comm = pycomm.Communicator(store=store, rank=rank, world_size=world)
    for step in range(steps):
        try:
            comm.all_reduce(grad, op="avg")
        except pycomm.CommError:
            comm = comm.shrink()        # survivors only; redo or drop this step
"""
from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, List, Sequence

import torch.distributed as dist

from . import bootstrap
from ._loader import CommError

if TYPE_CHECKING:
    from .communicator import Communicator

logger = logging.getLogger("pycomm")

# How often a waiting survivor polls the Store for the others' check-ins.
_POLL_S = 0.002


class _Fenced:
    """What a shrunk communicator's compiled part is replaced by: every use
    raises why, except what another shrink of it reads (a retry)."""

    def __init__(self, why: str, timeout: float, gone: List[int]) -> None:
        self._why, self.timeout, self._gone = why, timeout, gone

    def __getattr__(self, name: str):
        if name in ("shutdown", "abort"):  # closing or aborting it again is harmless
            return lambda *a, **k: None
        if name == "gone_ranks":
            return lambda: list(self._gone)
        raise CommError(self._why)


def _members_key(epoch: int) -> str:
    return f"epoch{epoch}/members"


def _agreement_store(comm: "Communicator", attempt: int) -> "dist.Store":
    """Where the ranks of ``comm`` agree in their ``attempt``-th shrink of it."""
    return dist.PrefixStore(f"pycomm/{comm.name}/{bootstrap.restart_prefix()}elastic/a{attempt}/", comm._root_store)


def shrink(comm: "Communicator", exclude: Sequence[int] = (), *, timeout: float = 30.0,
           grace: float = 2.0) -> "Communicator":
    """The survivors of ``comm`` in a new communicator (see the module's docstring).

    Args:
        comm: the communicator to shrink; every surviving rank passes its own.
        exclude: ranks of ``comm`` to leave out although they may be alive.
        timeout: seconds the new communicator's bootstrap may take (a member
            that died meanwhile makes it fail after this long).
        grace: seconds to wait for ranks not known to be gone to check in.

    Returns the new communicator: its ``epoch`` one more than ``comm``'s, its
    timeout ``comm``'s, and ``parent_ranks`` the members' ranks in ``comm``
    (its rank r was rank ``parent_ranks[r]`` of ``comm``). Raises CommError on a rank that is fenced out, on
    every member if one dies before the new communicator is built, and with a
    clear message if the Store cannot be reached.
    """
    from .communicator import Communicator

    world, me = comm.world_size, comm.rank
    bad = [r for r in exclude if not 0 <= int(r) < world]
    if bad:
        raise CommError(f"pycomm.shrink: exclude={list(exclude)} names ranks outside 0..{world - 1}")
    excluded = {int(r) for r in exclude}
    attempt = getattr(comm, "_shrink_attempts", 0)
    comm._shrink_attempts = attempt + 1
    epoch = comm.epoch + 1
    store = _agreement_store(comm, attempt)
    t0 = time.monotonic()
    gone = set(comm.gone_ranks()) | excluded
    old_timeout = comm.timeout
    # 1. Fence the old communicator first, for everybody: a peer still
    #    blocked in one of its collectives (waiting on this rank, perhaps
    #    across hosts) raises now and comes to shrink too, instead of at its
    #    timeout.
    why = (f"pycomm: communicator {comm.name!r} (epoch {comm.epoch}) is being replaced by a shrink; use the "
           "communicator shrink() returns")
    comm.abort(why, name_rank=False)
    comm.close()
    # Closing leaves the inter-host connections open until the compiled
    # communicator is gone; a peer on another host blocked on this rank
    # only sees a closed connection then.
    comm._c = _Fenced(why, old_timeout, sorted(gone - excluded))
    try:
        # 2. Check in, then wait for everybody not known to be gone.
        store.set(f"alive/{me}", "1")
        waiting = [r for r in range(world) if r not in gone and r != me]
        deadline = time.monotonic() + grace
        while waiting and time.monotonic() < deadline and not store.check([_members_key(epoch)]):
            waiting = [r for r in waiting if not store.check([f"alive/{r}"])]
            if waiting:
                time.sleep(_POLL_S)
        seen = [r for r in range(world) if r not in excluded and (r == me or store.check([f"alive/{r}"]))]
        # 3. One proposal wins; everybody reads it.
        decided = store.compare_set(_members_key(epoch), "", json.dumps(seen))
        members: List[int] = json.loads(decided.decode() if isinstance(decided, bytes) else decided)
    except CommError:
        raise
    except Exception as e:  # the Store's own errors: its host is gone, or a timeout
        raise CommError(f"pycomm.shrink: the Store cannot be reached ({type(e).__name__}: {e}); shrinking needs "
                        "a Store that outlives every training rank (torchrun's agent store, or a TCPStore "
                        "hosted outside the ranks)") from e
    if me not in members:
        raise CommError(f"pycomm.shrink: rank {me} was fenced out of {comm.name!r}: the survivors agreed on ranks "
                        f"{members} of epoch {epoch}" + (" (it was excluded)" if me in excluded else
                                                         " (it checked in too late)"))
    # 4. The members' new communicator: the old hosts kept (simulated ones
    #    too), fresh keys, segment and inter-host group.
    settings = dict(comm._settings)
    try:
        new = Communicator(store=comm._root_store, rank=members.index(me), world_size=len(members),
                           name=f"{comm.name}@a{attempt}", timeout=timeout, _host_label=f"h{comm.host}",
                           **settings)
    except CommError as e:
        raise CommError(f"pycomm.shrink: building the communicator of ranks {members} failed ({e}); a member "
                        "may have died meanwhile: call shrink() again") from e
    new.timeout = old_timeout
    new.epoch = epoch
    new.parent_ranks = members
    logger.info("pycomm: rank %d shrank %r to ranks %s (epoch %d) in %.3f s", me, comm.name, members, epoch,
                time.monotonic() - t0)
    return new
