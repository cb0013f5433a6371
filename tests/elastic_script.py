"""Run under torchrun --max-restarts=1: in the first attempt the last rank
kills itself in the middle of a stream of collectives; the restarted job
must come up cleanly on pycomm (backend and Communicator) and finish."""
import datetime
import os
import signal

import torch
import torch.distributed as dist

import pycomm


def main() -> None:
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("pycomm", timeout=datetime.timedelta(seconds=20))
    rank, world = dist.get_rank(), dist.get_world_size()
    comm = pycomm.Communicator(timeout=20)
    for step in range(200):
        if attempt == 0 and rank == world - 1 and step == 50:
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.full((4096,), float(rank + step))
        dist.all_reduce(t)
        assert t[0].item() == world * step + world * (world - 1) / 2
        u = torch.full((100,), float(rank))
        comm.all_reduce(u)
        assert u[0].item() == world * (world - 1) / 2
    comm.close()
    dist.destroy_process_group()
    print(f"OK rank {rank} attempt {attempt}", flush=True)


if __name__ == "__main__":
    main()
