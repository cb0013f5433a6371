"""Straggler-tolerant data parallelism on one host, and a straggler simulator.

:class:`DeadlineAverager` wraps an optimizer: each ``step()`` contributes this
rank's gradients to the global step that is open, and that step closes as
soon as every rank has contributed, or ``deadline`` seconds after its first
on-time contribution, or (``backups=b``) once ``n - b`` ranks have
contributed, whichever comes first. The contributors average among
themselves; a rank that missed the step is not waited for, and its gradient
is not lost: it goes into the next open step (computed on older parameters,
like the backup workers' late gradients of Chen et al., "Revisiting
distributed synchronous SGD", 2016, which are dropped there and kept here).
Every rank applies every closed step, in order, with the same bits, so
parameters and optimizer state stay identical on all ranks.

:class:`Straggler` makes one rank (or a random rank per step) slow, for tests
and benchmarks.

How it runs: the decisions (who contributed to which step) go through the
Store, a few operations per step; the gradients meet in one shared-memory
file per averager (created ``O_EXCL``, mode 0600, unlinked once every rank
has mapped it, so nothing stays in ``/dev/shm`` after a crash). That is why
it works within one host: a job whose ranks span hosts gets a clear error
(average per host with it and between hosts with a synchronous hook, or use
:class:`pycomm.hooks.StaleState`, which hides a slow link instead).
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
import random
import secrets
import threading
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import torch
import torch.distributed as dist

from . import _env, bootstrap
from ._loader import CommError

logger = logging.getLogger("pycomm")
# What rank 0 puts in the Store instead of the shared file's path when it
# could not create it: the others raise its reason at once.
_FAILED = "failed: "

__all__ = ["DeadlineAverager", "Straggler"]

_instances: Dict[str, int] = {}
_instances_lock = threading.Lock()


def _shard(numel: int, parts: int, index: int) -> Tuple[int, int]:
    """[lo, hi) of shard ``index`` of ``parts`` near-equal shards."""
    base, extra = divmod(numel, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def _ranks(mask: int) -> List[int]:
    return [r for r in range(mask.bit_length()) if mask >> r & 1]


class DeadlineAverager:
    """An optimizer wrapper that averages gradients among the ranks ready by a
    deadline (straggler-tolerant data parallelism within one host).

    The rule, per global step ``k`` (0, 1, 2, ...):

    1. A rank's ``step()`` contributes its gradients to the oldest step that
       is still open. The contribution is *on time* if the rank has applied
       every step before ``k`` (it computed on ``k``'s parameters), *late*
       otherwise.
    2. Step ``k`` closes when all ``n`` ranks contributed; or ``deadline``
       seconds after its first on-time contribution; or, with ``backups=b``,
       once ``n - b`` ranks contributed. One rank's decision wins (through
       the Store), so every rank sees the same set of contributors ``C_k``.
    3. The step's gradient is the plain average over ``C_k`` (each
       contribution is one rank's gradient of one step), summed in rank
       order: the same bits on every rank.
    4. A rank that arrived after ``k`` closed contributes to ``k + 1`` instead
       (its gradient arrives a step later, never dropped: summed over the
       steps, the contributions are all the gradients computed). Every rank
       applies every closed step in order (the optimizer steps once per
       global step, ``lr_scheduler`` too), so a slow rank catches up by
       applying the steps it missed before it computes again.

    The fast ranks thus wait at most ``deadline`` for a slow one; the slow
    one skips computing the steps it missed. Ranks therefore run different
    numbers of forwards and backwards: use the model itself, not a
    ``DistributedDataParallel`` wrapper (DDP's forward runs collectives that
    every rank must join: its bucket rebuild, buffer broadcasts). The
    constructor starts every rank from rank 0's parameters, as DDP's does. A rank that falls more than
    ``ring`` steps behind makes the others wait (bounded staleness: results
    are kept for ``ring`` steps).

    Args:
        optimizer: the wrapped optimizer (every parameter on the CPU).
        deadline: seconds after a step's first on-time contribution at which
            it closes without the missing ranks; ``None`` for backups only.
        backups: ``b``: close once ``n - b`` ranks contributed (backup
            workers); ``None`` for the deadline only.
        total_steps: the number of global steps to run: a late gradient that
            would open step ``total_steps`` is dropped (counted in
            :meth:`stats`) instead of waiting for ranks that have finished.
        lr_scheduler: stepped after every global step this rank applies.
        process_group, store, rank, world_size, name, timeout, local_size: as
            :class:`pycomm.Communicator`.
        ring: steps whose results stay readable (>= 2).

    Example::

        opt = DeadlineAverager(torch.optim.SGD(model.parameters(), lr=0.1), deadline=0.005,
                               total_steps=1000)      # starts every rank from rank 0's parameters
        while opt.step_count < 1000:
            opt.zero_grad(); loss_fn(model(next(batches)), ...).backward(); opt.step()
        opt.stats()["contributors"][-3:]    # e.g. [(0, 1, 2), (0, 1, 2, 3), (0, 1, 2)]
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, deadline: Optional[float] = 0.005,
                 backups: Optional[int] = None, total_steps: Optional[int] = None, lr_scheduler: Any = None,
                 process_group: Optional[dist.ProcessGroup] = None, store: Optional[dist.Store] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None, name: Optional[str] = None,
                 timeout: Optional[float] = None, local_size: Optional[int] = None, ring: int = 4) -> None:
        store, rank, world_size, group_name = bootstrap.resolve_group(process_group, store, rank, world_size)
        if deadline is None and backups is None:
            raise ValueError("pycomm.DeadlineAverager: pass deadline= (seconds) or backups= (ranks not waited "
                             "for); without either every step waits for every rank (use a synchronous hook)")
        if deadline is not None and not deadline >= 0:
            raise ValueError(f"pycomm.DeadlineAverager: deadline must be >= 0 seconds, got {deadline}")
        if backups is not None and not 0 <= int(backups) < world_size:
            raise ValueError(f"pycomm.DeadlineAverager: backups must be in [0, {world_size}), got {backups}")
        if int(ring) < 2:
            raise ValueError(f"pycomm.DeadlineAverager: ring must be >= 2, got {ring}")
        if world_size > 62:
            raise CommError(f"pycomm.DeadlineAverager: at most 62 ranks (one bit each in a Store counter), got "
                            f"{world_size}")
        self.optimizer = optimizer
        self.deadline = None if deadline is None else float(deadline)
        self.backups = None if backups is None else int(backups)
        self.total_steps = None if total_steps is None else int(total_steps)
        self.lr_scheduler = lr_scheduler
        self.rank, self.world_size, self.ring = rank, world_size, int(ring)
        self.timeout = (_env.seconds("PYCOMM_TIMEOUT", bootstrap.DEFAULT_TIMEOUT_S) if timeout is None
                        else _env.check_seconds(timeout, "timeout"))
        self._params = [p for g in optimizer.param_groups for p in g["params"]]
        bad = [p.device for p in self._params if p.device.type != "cpu"]
        if bad:
            raise CommError(f"pycomm.DeadlineAverager: parameters must be on the CPU (found {bad[0]}); the "
                            "contributions meet in host shared memory")
        # Where each parameter sits in a flat slot, computed once.
        self._spans: List[Tuple[torch.nn.Parameter, slice]] = []
        off = 0
        for p in self._params:
            self._spans.append((p, slice(off, off + p.numel())))
            off += p.numel()
        self._numel = off
        if self._numel == 0:
            raise ValueError("pycomm.DeadlineAverager: the optimizer has no parameters")
        self._dtype = torch.float64 if any(p.dtype == torch.float64 for p in self._params) else torch.float32
        if name is None:
            with _instances_lock:
                index = _instances.get(group_name, 0)
                _instances[group_name] = index + 1
            name = f"{group_name}/{index}"
        self._store = dist.PrefixStore(f"pycomm.deadline/{name}/{bootstrap.restart_prefix()}", store)
        topo = bootstrap.exchange_topology(self._store, rank, world_size, self.timeout, local_size)
        if topo.num_hosts > 1:
            raise CommError(f"pycomm.DeadlineAverager: the ranks span {topo.num_hosts} hosts; the deadline average "
                            "runs within one host (contributions meet in shared memory). Average per host with it "
                            "and between hosts with a synchronous hook, or hide slow links with "
                            "pycomm.hooks.StaleState")
        self._buf = self._map_shared()
        self.step_count = 0  # global steps applied
        self._stats = {"contributions": 0, "late": 0, "dropped": 0, "wait_seconds": 0.0}
        self._contributors: List[Tuple[int, ...]] = []

    # -------------------------------------------------------------- public

    @property
    def param_groups(self) -> List[dict]:
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self) -> int:
        """Contributes this rank's gradients, then applies every global step
        closed up to the one it went into. Returns the number of global steps
        applied (0 once ``total_steps`` is reached)."""
        t0 = time.perf_counter()
        if self.total_steps is not None and self.step_count >= self.total_steps:
            return 0
        # 1. This rank's gradients into its slot (nobody reads it until it
        #    registers below; it was last read by a step this rank applied).
        self._flatten(self._slot(self.rank))
        # 2. Join the open step; close it when everyone, the quorum or the
        #    deadline says so.
        joined = self._join()
        if joined is None:
            self._stats["dropped"] += 1
            last = self.total_steps - 1
        else:
            k, mask, late = joined
            self._stats["contributions"] += 1
            self._stats["late"] += int(late)
            # 3. Reduce this rank's shard of the step's average.
            self._reduce(k, mask)
            last = k
        # 4. Apply every step closed up to it, oldest first.
        applied = self._apply_until(last)
        self._stats["wait_seconds"] += time.perf_counter() - t0
        return applied

    def stats(self) -> Dict[str, Any]:
        """This rank's counts: ``steps`` applied, ``contributions`` made,
        ``late`` ones (went into a later step than the one computed for),
        ``dropped`` ones (after the last step), ``wait_seconds`` spent in
        :meth:`step`, and ``contributors``: the ranks that made each global
        step, in step order (the same list on every rank)."""
        out: Dict[str, Any] = dict(self._stats)
        out["steps"] = self.step_count
        out["contributors"] = list(self._contributors)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "step_count": self.step_count}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.step_count = int(state["step_count"])

    def close(self) -> None:
        """Unmaps the shared file (also when garbage collected)."""
        self._buf = None

    def __repr__(self) -> str:
        return (f"DeadlineAverager(deadline={self.deadline}, backups={self.backups}, rank={self.rank}, "
                f"world_size={self.world_size}, {self.optimizer!r})")

    # -------------------------------------------------------------- shared memory

    @torch.no_grad()
    def _map_shared(self) -> torch.Tensor:
        """One file of (world + ring) * numel elements: each rank's slot, then
        the ring of results. Rank 0 creates it (O_EXCL, 0600) with its
        parameters in its slot; every rank starts from them (as DDP's
        constructor does) once it has mapped the file, and rank 0 unlinks it
        once every rank has. Rank 0's slot then takes its first gradient, in
        step(), after the constructor returned everywhere."""
        count = (self.world_size + self.ring) * self._numel
        nbytes = count * torch.empty(0, dtype=self._dtype).element_size()
        if self.rank == 0:
            path = f"/dev/shm/pycomm.deadline.{secrets.token_hex(12)}"
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                # Taken whole now: a sparse file that the tmpfs cannot back
                # later kills the process with SIGBUS at the first touch.
                os.ftruncate(fd, nbytes)
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                os.close(fd)
                os.unlink(path)
                why = (f"pycomm.DeadlineAverager: cannot take {nbytes} bytes of shared memory in /dev/shm: {e} "
                       "(give /dev/shm more room, e.g. docker run --shm-size=1g)")
                self._store.set("file", _FAILED + why)
                raise CommError(why) from e
            os.close(fd)
        else:
            bootstrap.wait_keys(self._store, ["file"], self.timeout, "rank 0 to create the shared file")
            path = self._store.get("file").decode()
            if path.startswith(_FAILED):
                raise CommError(f"pycomm.DeadlineAverager: rank 0 could not create the shared file: "
                                f"{path[len(_FAILED):]}")
        try:
            buf = torch.from_file(path, shared=True, size=count, dtype=self._dtype)
            slot0 = buf[:self._numel]
            if self.rank == 0:
                for p, span in self._spans:
                    slot0[span].copy_(p.reshape(-1))
                self._store.set("file", path)
            else:
                for p, span in self._spans:
                    p.copy_(slot0[span].view(p.shape))
            if self._store.add("mapped", 1) == self.world_size:
                self._store.set("all_mapped", "1")
            if self.rank == 0:
                bootstrap.wait_keys(self._store, ["all_mapped"], self.timeout, "every rank to map the shared file")
        finally:
            if self.rank == 0:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                self._store.set("unlinked", "1")
        # Return only once the name is gone: from here a crash leaks nothing.
        bootstrap.wait_keys(self._store, ["unlinked"], self.timeout, "rank 0 to unlink the shared file")
        return buf

    def _slot(self, rank: int) -> torch.Tensor:
        return self._buf[rank * self._numel:(rank + 1) * self._numel]

    def _result(self, step: int) -> torch.Tensor:
        i = self.world_size + step % self.ring
        return self._buf[i * self._numel:(i + 1) * self._numel]

    def _flatten(self, out: torch.Tensor) -> None:
        for p, span in self._spans:
            if p.grad is None:
                out[span].zero_()
            else:
                out[span].copy_(p.grad.reshape(-1))

    def _unflatten(self, src: torch.Tensor) -> None:
        for p, span in self._spans:
            part = src[span].view(p.shape)
            if p.grad is None:
                p.grad = part.to(p.dtype, copy=True)
            else:
                p.grad.copy_(part)

    # -------------------------------------------------------------- protocol

    def _wait(self, key: str, what: str) -> None:
        try:
            self._store.wait([key], datetime.timedelta(seconds=self.timeout))
        except Exception as e:  # the Store raises its own timeout types
            raise CommError(f"pycomm.DeadlineAverager: rank {self.rank} timed out after {self.timeout:g} s "
                            f"waiting for {what} (a rank died, or stopped calling step())") from e

    def _join(self) -> Optional[Tuple[int, int, bool]]:
        """Registers this rank's slot in the oldest open step, applying the
        closed ones it passes: (step, its contributors' mask, whether this
        contribution is late), or None when that step would be past
        ``total_steps``."""
        n, me = self.world_size, 1 << self.rank
        k = computed_for = self.step_count
        while True:
            if self.total_steps is not None and k >= self.total_steps:
                return None
            close = f"close/{k}"
            if self._store.check([close]):
                # Apply a step that closed without us before joining a later
                # one: the ranks that reduce step k + ring wait until every
                # rank has applied step k, and a late rank waiting for a
                # step to close must not be the one they wait for.
                self._apply_until(k)
                k += 1
                continue
            # Store.add returns the counter after ours: the mask of who has
            # joined so far (each rank adds its bit once per step).
            mask = self._store.add(f"mask/{k}", me)
            joined = bin(mask).count("1")
            if joined == n or (self.backups is not None and joined >= n - self.backups):
                self._store.compare_set(close, "", str(mask))
            elif (k == computed_for and self.deadline is not None
                  and self._store.add(f"fresh/{k}", 1) == 1):
                self._time_deadline(k)
            self._wait(close, f"global step {k} to close")
            closed = int(self._store.get(close))
            if closed & me:
                return k, closed, k != computed_for
            # It closed without us: our gradient goes into the next step.
            self._apply_until(k)
            k += 1

    def _time_deadline(self, k: int) -> None:
        """The step's first on-time contributor closes it at the deadline
        unless it closed before (polled: a Store wait that times out logs a
        warning from c10d each time)."""
        close = f"close/{k}"
        end = time.monotonic() + self.deadline
        poll = max(0.0005, self.deadline / 20)
        while True:
            left = end - time.monotonic()
            if left <= 0:
                break
            if self._store.check([close]):
                return
            time.sleep(min(poll, left))
        self._store.compare_set(close, "", str(self._store.add(f"mask/{k}", 0)))

    def _reduce(self, k: int, mask: int) -> None:
        """This rank's shard of step k's average over its contributors."""
        ranks = _ranks(mask)
        c = len(ranks)
        if k >= self.ring:
            # The result slot was step k - ring's: reuse it once every rank
            # has applied that step.
            self._wait(f"free/{k - self.ring}", f"every rank to apply global step {k - self.ring} "
                       f"(a rank is more than ring={self.ring} steps behind)")
        lo, hi = _shard(self._numel, c, ranks.index(self.rank))
        out = self._result(k)[lo:hi]
        out.copy_(self._slot(ranks[0])[lo:hi])
        for r in ranks[1:]:
            out.add_(self._slot(r)[lo:hi])
        out.div_(c)
        if self._store.add(f"done/{k}", 1) == c:
            self._store.set(f"ready/{k}", "1")

    def _apply_until(self, last: int) -> int:
        applied = 0
        while self.step_count <= last:
            j = self.step_count
            self._wait(f"ready/{j}", f"the average of global step {j}")
            self._contributors.append(tuple(_ranks(int(self._store.get(f"close/{j}")))))
            self._unflatten(self._result(j))
            self.optimizer.step()
            if self.lr_scheduler is not None:
                self.lr_scheduler.step()
            self.step_count += 1
            applied += 1
            if self._store.add(f"read/{j}", 1) == self.world_size:
                # Everyone has applied j: its result slot is free, and nobody
                # looks at its keys again (every rank joins steps > j, and
                # step j's contributors waited for free/{j - ring} already).
                self._store.set(f"free/{j}", "1")
                for key in ("mask", "fresh", "close", "done", "ready", "read"):
                    self._store.delete_key(f"{key}/{j}")
                if j >= self.ring:
                    self._store.delete_key(f"free/{j - self.ring}")
        return applied


class Straggler:
    """Makes a rank slow, for tests and benchmarks of straggler tolerance.

    ``rank`` is the slow rank: an int, or ``"random"`` for a rank drawn per
    step (the same draw on every rank, from ``seed``). The slow rank sleeps
    ``delay`` seconds per step plus ``slowdown`` times the step's own
    duration (``slowdown=0.5``: 50 % slower).

    Example::

        straggler = pycomm.Straggler(rank=3, slowdown=0.5)
        for step in range(steps):
            with straggler.step(step, dist.get_rank()):
                loss_fn(model(x), y).backward()
            opt.step()
    """

    def __init__(self, rank: Union[int, str, None], *, delay: float = 0.0, slowdown: float = 0.0,
                 seed: int = 0) -> None:
        if not (rank is None or rank == "random" or (isinstance(rank, int) and rank >= 0)):
            raise ValueError(f"pycomm.Straggler: rank must be a rank, 'random' or None, got {rank!r}")
        if delay < 0 or slowdown < 0:
            raise ValueError("pycomm.Straggler: delay and slowdown must be >= 0")
        self.rank, self.delay, self.slowdown, self.seed = rank, float(delay), float(slowdown), int(seed)

    def slow_rank(self, step: int, world_size: int) -> Optional[int]:
        """The rank that is slow at ``step`` (None: nobody)."""
        if self.rank == "random":
            return random.Random(self.seed * 1000003 + step).randrange(world_size)
        return self.rank

    def sleep(self, step: int, rank: int, world_size: int, elapsed: float = 0.0) -> float:
        """Sleeps if ``rank`` is slow at ``step``; returns the seconds slept."""
        if self.slow_rank(step, world_size) != rank:
            return 0.0
        t = self.delay + self.slowdown * elapsed
        if t > 0:
            time.sleep(t)
        return t

    @contextlib.contextmanager
    def step(self, step: int, rank: int, world_size: Optional[int] = None) -> Iterator[None]:
        """Times the block, then sleeps if ``rank`` is slow at ``step``."""
        if world_size is None:
            world_size = dist.get_world_size() if dist.is_initialized() else 1
        t = time.perf_counter()
        yield
        self.sleep(step, rank, world_size, time.perf_counter() - t)
