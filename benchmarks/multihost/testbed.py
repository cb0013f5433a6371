"""A simulated multi-host cluster on one Linux machine, for benchmarks and tests.

H network namespaces ("hosts") hang off a bridge that lives in a namespace of
its own, each through a veth pair whose both ends are shaped with tc (the
host's link, in both directions): netem for rate and one-way delay, or, on
kernels without sch_netem, tbf for the rate alone (the delay is then the
veth's own, a few microseconds, and the testbed says so). The
command runs under torchrun in every host namespace, one node per host, with
GLOO_SOCKET_IFNAME pointing at the host's link. Everything is created fresh,
and deleted on exit, on Ctrl-C and on failure; the machine's own network
namespace is never touched.

Needs root and iproute2 (installed with apt-get when missing).

Example (4 hosts x 1 rank at 1 Gbit/s, 0.1 ms, pycomm-bench against gloo)::

    python benchmarks/multihost/testbed.py --hosts 4 --nproc-per-host 1 -- \\
        -m pycomm.bench -b 1M -e 64M -a ring,direct,hierarchical

Everything after ``--`` is what torchrun runs (a script and its arguments,
or ``-m module ...``).
"""
from __future__ import annotations

import argparse
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import time
from typing import List, Optional, Sequence


class TestbedError(RuntimeError):
    pass


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if check and p.returncode != 0:
        raise TestbedError(f"{' '.join(cmd)} failed: {p.stderr.strip() or p.stdout.strip()}")
    return p


def ensure_tools() -> None:
    """Root and iproute2 (ip, tc), installing iproute2 if it is missing."""
    if os.geteuid() != 0:
        raise TestbedError("the multi-host testbed needs root (it creates network namespaces)")
    if shutil.which("ip") and shutil.which("tc"):
        return
    if shutil.which("apt-get"):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        subprocess.run(["apt-get", "install", "-y", "-q", "iproute2"], env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        if not (shutil.which("ip") and shutil.which("tc")):
            subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            subprocess.run(["apt-get", "install", "-y", "-q", "iproute2"], env=env, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
    if not (shutil.which("ip") and shutil.which("tc")):
        raise TestbedError("the multi-host testbed needs iproute2 (ip, tc); install it with your package manager")


def supported() -> Optional[str]:
    """None if namespaces, veth, bridges and netem work here, else why not."""
    try:
        ensure_tools()
        with Testbed(hosts=2, rate="1gbit", delay="0.1ms"):
            pass
    except (TestbedError, OSError) as e:
        return str(e)
    return None


class Testbed:
    """H host namespaces on one bridge, each link shaped; a context manager.

    Host h has address ``10.<net>.0.<h+1>`` on its interface ``eth0``.
    """

    def __init__(self, hosts: int, rate: str = "1gbit", delay: str = "0.1ms") -> None:
        if hosts < 1 or hosts > 200:
            raise TestbedError("--hosts must be 1..200")
        self.hosts = hosts
        self.rate = rate
        self.delay = delay
        self.token = secrets.token_hex(3)
        self.net = random.randint(64, 250)
        self.switch = f"pycomm-{self.token}-sw"
        self.names = [f"pycomm-{self.token}-h{h}" for h in range(hosts)]
        self.created: List[str] = []
        self.shaper = ""  # "netem" or "tbf", found on the first link

    def describe(self) -> str:
        delay = f"{self.delay} one way per end" if self.shaper == "netem" else \
            "no added delay (this kernel has no sch_netem; rate only, via tbf)"
        return f"links {self.rate} each direction, {delay}"

    def address(self, host: int) -> str:
        return f"10.{self.net}.0.{host + 1}"

    def __enter__(self) -> "Testbed":
        try:
            self._create()
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.teardown()

    def _shape(self, ns: str, dev: str) -> None:
        tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root"]
        if self.shaper != "tbf":
            # netem on the egress of each end: the rate bounds the link in
            # that direction, the delay is one way. The queue holds a few ms
            # at the rate, like a switch port, instead of dropping bursts.
            p = _run(tc + ["netem", "delay", self.delay, "rate", self.rate, "limit", "10000"], check=False)
            if p.returncode == 0:
                self.shaper = "netem"
                return
            if "unknown" not in (p.stderr + p.stdout).lower() or self.shaper == "netem":
                raise TestbedError(f"tc netem on {dev} failed: {p.stderr.strip()}")
            self.shaper = "tbf"
        # tbf: a token bucket at the rate. The bucket holds a few 64 KiB
        # segments (veth hands tc whole GSO segments), which over a transfer
        # of megabytes lets through well under 1% above the rate; the queue
        # holds ~30 ms at 1 Gbit/s.
        _run(tc + ["tbf", "rate", self.rate, "burst", "256kb", "limit", "4mb"])
    def _create(self) -> None:
        _run(["ip", "netns", "add", self.switch])
        self.created.append(self.switch)
        sw = ["ip", "-n", self.switch]
        _run(sw + ["link", "add", "br0", "type", "bridge"])
        _run(sw + ["link", "set", "br0", "up"])
        _run(sw + ["link", "set", "lo", "up"])
        for h, ns in enumerate(self.names):
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
            # Both ends are created inside the switch namespace, then one moves
            # into the host: nothing ever appears in the caller's namespace.
            _run(sw + ["link", "add", f"p{h}", "type", "veth", "peer", "name", f"v{h}"])
            _run(sw + ["link", "set", f"v{h}", "netns", ns])
            _run(sw + ["link", "set", f"p{h}", "master", "br0"])
            _run(sw + ["link", "set", f"p{h}", "up"])
            hn = ["ip", "-n", ns]
            _run(hn + ["link", "set", f"v{h}", "name", "eth0"])
            _run(hn + ["addr", "add", f"{self.address(h)}/16", "dev", "eth0"])
            _run(hn + ["link", "set", "eth0", "up"])
            _run(hn + ["link", "set", "lo", "up"])
            self._shape(ns, "eth0")
            self._shape(self.switch, f"p{h}")

    def teardown(self) -> None:
        for ns in reversed(self.created):
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            _run(["ip", "netns", "del", ns], check=False)
        self.created.clear()

    def launch(self, nproc_per_host: int, command: Sequence[str], env: Optional[dict] = None,
               timeout: Optional[float] = None, stdout=None) -> int:
        """Runs ``torchrun <command>`` on every host; returns the first non-zero exit code (or 0)."""
        port = random.randint(20000, 40000)
        # The simulated hosts share this machine's cores: a rank that spins
        # while it waits (pycomm does, briefly, on a host with a core per
        # rank) would steal them from the other hosts and from the kernel,
        # which runs the simulated network.
        base_env = dict({"TORCH_CPP_LOG_LEVEL": "ERROR", "PYCOMM_SPIN_US": "5"}, **os.environ)
        base_env.update(GLOO_SOCKET_IFNAME="eth0", NCCL_SOCKET_IFNAME="eth0", NCCL_IB_DISABLE="1",
                        OMP_NUM_THREADS="1", **(env or {}))
        procs = []
        for h, ns in enumerate(self.names):
            # NCCL tells hosts apart by a host id (the boot id by default, the
            # same for every namespace here): each simulated host gets its own,
            # so NCCL sends between them over the sockets of their links, and
            # ranks of several hosts may share one GPU (it refuses two ranks on
            # one GPU of one host).
            host_env = dict(base_env)
            host_env.setdefault("NCCL_HOSTID", f"pycomm-testbed-host-{h}")
            cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={self.hosts}", f"--node-rank={h}", f"--nproc-per-node={nproc_per_host}",
                   f"--master-addr={self.address(0)}", f"--master-port={port}", *command]
            procs.append(subprocess.Popen(cmd, env=host_env, stdout=stdout, stderr=subprocess.STDOUT
                                          if stdout is not None else None, start_new_session=True))
        deadline = None if timeout is None else time.monotonic() + timeout
        code = 0
        try:
            for p in procs:
                left = None if deadline is None else max(0.1, deadline - time.monotonic())
                rc = p.wait(timeout=left)
                code = code or rc
        except subprocess.TimeoutExpired:
            code = 124
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
        return code


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1:]
    else:
        command = []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hosts", type=int, default=4, help="simulated hosts (default 4)")
    p.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host (default 1)")
    p.add_argument("--rate", default="1gbit", help="each host's link, each direction (tc rate; default 1gbit)")
    p.add_argument("--delay", default="0.1ms", help="one-way delay added on each end of a link (default 0.1ms)")
    p.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
    args = p.parse_args(argv)
    if not command:
        p.error("give the command torchrun runs after --, e.g. -- -m pycomm.bench -b 1M -e 64M")

    # Ctrl-C and SIGTERM unwind through the context manager's teardown.
    def _stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    try:
        ensure_tools()
        with Testbed(args.hosts, args.rate, args.delay) as tb:
            print(f"# testbed: {args.hosts} hosts x {args.nproc_per_host} ranks, {tb.describe()}; "
                  f"hosts {tb.address(0)}..{tb.address(args.hosts - 1)}", flush=True)
            return tb.launch(args.nproc_per_host, command, timeout=args.timeout)
    except TestbedError as e:
        print(f"testbed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("testbed: interrupted; namespaces removed", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
