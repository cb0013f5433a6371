"""DDP communication hooks that send gradients through pycomm.

Register one on an existing ``DistributedDataParallel`` model, on any DDP
backend (gloo, nccl, pycomm)::

    import pycomm
    from pycomm import hooks

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(hooks.AllReduceState(), hooks.allreduce_hook)           # plain, float32
    ddp.register_comm_hook(hooks.AllReduceState(wire_dtype=torch.bfloat16), hooks.allreduce_hook)
    ddp.register_comm_hook(hooks.CompressionState(start_iter=10), hooks.int8_hook)  # or int4_hook
    ddp.register_comm_hook(hooks.CompressionState(codec=pycomm.TopK(0.01)), hooks.topk_hook)
    ddp.register_comm_hook(hooks.PowerSGDState(rank=4), hooks.powersgd_hook)    # low-rank factors

Every hook has torch's signature ``hook(state, bucket) -> Future[Tensor]``:
it hands the bucket to pycomm's progress engine and returns at once; the
future completes on the progress thread, so backward keeps computing while
buckets travel. The future holds the bucket averaged over ranks (DDP does not
pre-divide). Each state keeps running statistics (:meth:`HookState.stats`),
and ``torch.profiler`` shows every bucket's ``pycomm::compress``,
``pycomm::communicate``, ``pycomm::reduce`` and ``pycomm::decompress`` ranges.

Compressed hooks keep error-feedback residuals per bucket, keyed by the
bucket's parameters: when DDP rebuilds its buckets after the first iteration
(or a bucket's layout changes), each parameter's residual moves to its new
place. Like PyTorch's PowerSGD hook they can start uncompressed for
``start_iter`` iterations.

Local SGD (periodic model averaging) is :class:`LocalSGD` (an optimizer
wrapper) together with :func:`local_sgd_hook`, which stops averaging
gradients after a warm-up.

Which path a bucket takes (the policy; logged once per kind of bucket, at
INFO, with the reason):

* CPU buckets: pycomm's :class:`~pycomm.Communicator` (shared memory within a
  host, its inter-host transport between hosts).
* CUDA buckets, compressed: :class:`~pycomm.GroupCommunicator`, the same
  algorithm composed from pycomm's CUDA kernels and the group's own
  collectives (NCCL), everything on the device.
* CUDA buckets, plain (``allreduce_hook``, ``bf16_hook``): CUDA IPC when every
  rank is on one host, each on its own GPU; otherwise the group's own
  all-reduce.

``path=`` on a state (or the ``PYCOMM_HOOK_PATH`` environment variable)
forces ``"group"`` (any device; CPU buckets then go over Gloo), ``"ipc"``
(CUDA buckets) or ``"communicator"`` (CPU buckets).

GPU set-up (DDP on NCCL, gradients sent as int8)::

    dist.init_process_group("nccl")            # or "cpu:pycomm,cuda:nccl"
    ddp = DistributedDataParallel(model.cuda(), device_ids=[local_rank])
    ddp.register_comm_hook(hooks.CompressionState(start_iter=10), hooks.int8_hook)

Every state has ``state_dict()`` / ``load_state_dict()`` (iteration count and
error-feedback residuals) for checkpoints.
"""
from .compressed import CompressionState, compression_hook, int4_hook, int8_hook, topk_hook
from .local_sgd import LocalSGD, LocalSGDState, local_sgd_hook
from .plain import AllReduceState, allreduce_hook, bf16_hook
from .policy import PATHS, Router, completed, ipc_refusal
from .powersgd import PowerSGD, PowerSGDState, orthogonalize_, powersgd_hook
from .stale import StaleState, stale_hook
from .state import HookState

__all__ = [
    "AllReduceState",
    "CompressionState",
    "HookState",
    "LocalSGD",
    "LocalSGDState",
    "PATHS",
    "PowerSGD",
    "PowerSGDState",
    "Router",
    "StaleState",
    "allreduce_hook",
    "bf16_hook",
    "completed",
    "compression_hook",
    "int4_hook",
    "int8_hook",
    "ipc_refusal",
    "local_sgd_hook",
    "orthogonalize_",
    "powersgd_hook",
    "stale_hook",
    "topk_hook",
]
