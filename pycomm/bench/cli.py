"""Command line of pycomm-bench: parse nccl-tests-style options, launch the
ranks (or join torchrun's), print the table, write JSON and a plot."""
from __future__ import annotations

import argparse
import datetime
import logging
import math
import os
import platform
import socket
import sys
from typing import Dict, List, Optional

from .._env import parse_size as parse_bytes
from .report import HEADER, format_size, plot, summary, write_json

COLLECTIVES = ["all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"]
# "c10d": torch.distributed calls on a group whose backend is "pycomm"
# (what a script gets from init_process_group("cpu:pycomm")).
ALGOS = ["ring", "tree", "direct", "hierarchical", "auto", "c10d"]


def parse_size(text: str) -> int:
    try:
        value = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad size {text!r} (use e.g. 8, 1K, 64M)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pycomm-bench",
        description="nccl-tests-style benchmark of pycomm collectives against the torch.distributed "
                    "backend (gloo on CPU), measured in the same run.",
    )
    p.add_argument("-b", "--minbytes", type=parse_size, default=parse_size("1K"), help="smallest size (default 1K)")
    p.add_argument("-e", "--maxbytes", type=parse_size, default=parse_size("64M"), help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="multiply the size by this each step (default 4)")
    p.add_argument("-c", "--collective", default="all_reduce",
                   help=f"comma-separated collectives ({', '.join(COLLECTIVES)}) or all: one table each, in one "
                        "launch (default all_reduce)")
    p.add_argument("-a", "--algorithms", default="ring,tree,direct,auto",
                   help="comma-separated pycomm algorithms (ring, tree, direct, hierarchical, auto), "
                        "and c10d: dist.* calls on a \"pycomm\" process group")
    p.add_argument("-d", "--dtype", default="float32", help="float32, float64, float16, bfloat16, int32, int64")
    p.add_argument("-o", "--op", default="sum", choices=["sum", "avg", "max", "min"])
    p.add_argument("-n", "--iters", type=int, default=None, help="timed iterations per point (default: by size)")
    p.add_argument("-w", "--warmup", type=int, default=None, help="warm-up iterations per point")
    p.add_argument("--nproc", type=int, default=2, help="local ranks to launch (ignored under torchrun)")
    p.add_argument("--no-baseline", action="store_true", help="skip the torch.distributed baseline")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot bandwidth and latency against size")
    p.add_argument("--timeout", type=float, default=120.0, help="pycomm collective timeout in seconds")
    p.add_argument("--registered", action="store_true",
                   help="also run every algorithm on registered buffers (comm.empty; '+reg' rows) and time a plain "
                        "copy of the buffer on every rank at once (the 'memcpy' row)")
    p.add_argument("--bind-cores", action="store_true",
                   help="bind each rank to its share of the CPUs (pycomm.Communicator(bind_cores=True))")
    p.add_argument("--compression", metavar="CODECS", default=None,
                   help="also time pycomm's compressed all-reduce with these codecs, comma-separated: int8, int4, "
                        "topk, with a block or ratio (int8:64, int4:128:stochastic, topk:0.001, topk:0.01:exact); "
                        "each element is checked against the codec's accuracy")
    p.add_argument("--in-place", action="store_true",
                   help="run reduce_scatter and all_gather in place, as nccl-tests' in-place columns (all_reduce "
                        "and broadcast always are; all_to_all has no in-place form in NCCL): the output is this "
                        "rank's block of the input (reduce_scatter), the input this rank's block of the output "
                        "(all_gather); the baseline too")
    p.add_argument("--deepspeed", action="store_true",
                   help="also time DeepSpeed's shared-memory all-reduce in the same processes (needs "
                        "`pip install deepspeed`; all_reduce, op sum, float32/bfloat16/float16)")
    return p


def validate(args: argparse.Namespace) -> Dict[str, List[str]]:
    """The algorithms to run per collective, in the order asked; SystemExit
    naming what is wrong with the options."""
    from .runner import DTYPES

    if args.dtype not in DTYPES:
        raise SystemExit(f"pycomm-bench: unknown dtype {args.dtype!r} (one of {', '.join(DTYPES)})")
    if args.minbytes > args.maxbytes:
        raise SystemExit("pycomm-bench: -b must not exceed -e")
    if args.stepfactor < 2:
        raise SystemExit("pycomm-bench: -f must be at least 2")
    if args.nproc < 1:
        raise SystemExit("pycomm-bench: --nproc must be at least 1")
    if args.iters is not None and args.iters < 1:
        raise SystemExit("pycomm-bench: -n must be at least 1 (leave it out to choose by size)")
    if args.warmup is not None and args.warmup < 0:
        raise SystemExit("pycomm-bench: -w must not be negative")
    if not math.isfinite(args.timeout) or args.timeout <= 0:
        raise SystemExit("pycomm-bench: --timeout must be a number of seconds above 0")
    colls = collectives(args)
    if args.plot and len(colls) > 1:
        raise SystemExit("pycomm-bench: --plot draws one collective: run once per collective")
    asked = [a.strip() for a in args.algorithms.split(",") if a.strip()]
    for a in asked:
        if a not in ALGOS:
            raise SystemExit(f"pycomm-bench: unknown algorithm {a!r} (use {', '.join(ALGOS)})")
    if args.op == "avg" and not DTYPES[args.dtype].is_floating_point:
        raise SystemExit("pycomm-bench: avg needs a floating-point dtype")
    if args.deepspeed and (colls != ["all_reduce"] or args.op != "sum"
                           or args.dtype not in ("float32", "float", "bfloat16", "float16", "half")):
        raise SystemExit("pycomm-bench: --deepspeed times DeepSpeed's shared-memory all-reduce, which does "
                         "all_reduce with op sum on float32, bfloat16 or float16 only")
    plan = {}
    for coll in colls:
        algos = list(asked)
        if coll in ("reduce_scatter", "all_gather") and "tree" in algos:
            algos.remove("tree")  # no tree schedule for these (the header lists what runs)
        if coll == "all_to_all":
            # One algorithm (every block reaches its owner in one step): one row.
            algos = ["auto"] + (["c10d"] if "c10d" in algos else [])
        codecs(args, coll)
        plan[coll] = algos
    return plan


def collectives(args: argparse.Namespace) -> List[str]:
    """-c as a list: comma-separated names, or all."""
    text = args.collective.strip()
    names = COLLECTIVES if text == "all" else [c.strip() for c in text.split(",") if c.strip()]
    for c in names:
        if c not in COLLECTIVES:
            raise SystemExit(f"pycomm-bench: unknown collective {c!r} (use {', '.join(COLLECTIVES)}, or all)")
    if not names or len(set(names)) != len(names):
        raise SystemExit(f"pycomm-bench: -c names each collective once (got {args.collective!r})")
    return names


def codecs(args: argparse.Namespace, collective: str) -> list:
    """The --compression codecs (pycomm.Int8(), ...) for one collective, or
    SystemExit naming what is wrong."""
    from .compressed import check_options
    from .runner import DTYPES

    return check_options([s for s in (args.compression or "").split(",") if s.strip()], collective, args.op,
                         DTYPES[args.dtype])


def sizes(args: argparse.Namespace) -> List[int]:
    out, s = [], args.minbytes
    while s <= args.maxbytes:
        out.append(s)
        s *= args.stepfactor
    return out


def _rank_main(rank: int, world: int, port: Optional[int], args: argparse.Namespace,
               plan: Dict[str, List[str]]) -> None:
    import torch
    import torch.distributed as dist

    import pycomm

    from .runner import BenchConfig, run_rank

    # One process per core, like torchrun's default: torch's own thread pool
    # would otherwise compete with the ranks for the cores.
    torch.set_num_threads(1)
    if args.deepspeed:
        from .deepspeed_shm import load

        load()  # before the group exists: DeepSpeed must not hold it past destroy_process_group
    if port is not None:
        # DeepSpeed names its segment after the master's address and port.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(60, args.timeout)))
    else:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=max(60, args.timeout)))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = pycomm.Communicator(timeout=args.timeout, bind_cores=args.bind_cores or None)
    deepspeed = None
    if args.deepspeed:
        from .deepspeed_shm import setup

        deepspeed = setup(comm.local_size)
    c10d_group = None
    if any("c10d" in algos for algos in plan.values()):
        c10d_group = dist.new_group(backend="pycomm", timeout=datetime.timedelta(seconds=args.timeout))
    rows: Optional[list] = [] if rank == 0 else None
    if rank == 0:
        print(f"# host {socket.gethostname()} ({platform.machine()}, {os.cpu_count()} cpus), "
              f"torch {torch.__version__}, pycomm {pycomm.__version__}, shm round {format_size(comm.round_bytes)}B, "
              f"hosts {comm.num_hosts} x local ranks {comm.local_size}, transport {comm.transport}, "
              f"cores {'bound: rank 0 on ' + str(comm.cpus) if comm.cpus else 'not bound'}")
        print("# time: median per call of the slowest rank; busbw = algbw x nccl-tests factor; "
              "#wrong: elements off the closed-form result")
    # One table per collective, each under its own header (what one
    # nccl-tests binary per collective prints); the summary and the #wrong
    # total cover them all.
    for coll, algos in plan.items():
        if rank == 0:
            print(f"# pycomm-bench: {coll}, {world} ranks, dtype {args.dtype}, op {args.op}, "
                  f"algorithms {','.join(algos)}{', compression ' + args.compression if args.compression else ''}"
                  f"{', in place' if args.in_place and coll in ('reduce_scatter', 'all_gather') else ''}, "
                  f"baseline {'none' if args.no_baseline else dist.get_backend()}"
                  f"{' and deepspeed-shm' if args.deepspeed else ''}")
            print(HEADER, flush=True)
        cfg = BenchConfig(coll, sizes(args), algos, args.dtype, args.op, args.iters, args.warmup,
                          not args.no_baseline, registered=args.registered, codecs=codecs(args, coll),
                          in_place=args.in_place)
        cfg.deepspeed = deepspeed
        cfg.c10d_group = c10d_group if "c10d" in algos else None
        got = run_rank(cfg, comm)
        if rows is not None and got is not None:
            rows += got
    if rank == 0 and rows is not None:
        print("#")
        for line in summary(rows):
            print("# " + line)
        wrong = sum(r["wrong"] for r in rows)
        print(f"# total #wrong: {wrong}", flush=True)
        if args.json:
            write_json(rows, args.json)
            print(f"# wrote {args.json}")
        if args.plot:
            plot(rows, args.plot, title=f"{next(iter(plan))}, {world} ranks, {args.dtype}")
            print(f"# wrote {args.plot}")
    comm.close()
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0 and rows is not None and sum(r["wrong"] for r in rows):
        sys.exit(3)


def _spawned(rank: int, world: int, port: int, args: argparse.Namespace, plan: Dict[str, List[str]]) -> None:
    _rank_main(rank, world, port, args, plan)


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = build_parser().parse_args(argv)
    plan = validate(args)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, plan)
        return
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        mp.start_processes(_spawned, args=(args.nproc, port, args, plan), nprocs=args.nproc,
                           start_method="spawn")
    except mp.ProcessExitedException as e:
        raise SystemExit(f"pycomm-bench: rank {e.error_index} exited with code {e.exit_code}") from None
    except mp.ProcessRaisedException as e:
        raise SystemExit(f"pycomm-bench: a rank failed:\n{e}") from None


if __name__ == "__main__":
    main()
