"""pycomm-bench: nccl-tests-style microbenchmarks of pycomm against the
torch.distributed backend (gloo on CPU), measured in the same run.

    pycomm-bench                        # all_reduce, 2 local ranks, 1K..64M
    pycomm-bench --nproc 4 -b 8 -e 1M -f 2 --collective all_gather --json out.json --plot out.png
    torchrun --nproc-per-node 4 -m pycomm.bench -b 1M -e 64M
"""
