"""Worker-side case: pycomm's DDP comm hooks under ``torch.compile`` (run
inside the hooks suite's workers, on its groups and communicators). Compiled
DDP (TorchDynamo's DDPOptimizer) cuts the graph at bucket boundaries and
still calls the registered hook for every bucket: the hook must see the
same buckets, hand back the same averages on every rank, and do what it
does in eager mode."""
from __future__ import annotations

from typing import Dict

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import pycomm

from hooks_cases import HOOKS, _grads, _group, _state, make_batch, make_model


def compiled_hook(rank: int, world: int, hook: str, iters: int = 3) -> Dict[str, object]:
    """Three backward passes (no optimizer step, so every pass's gradients
    compare) of the MLP under four DDPs on the same batches: compiled without
    a hook, compiled with ``hook``, eager with ``hook``. Returns the relative
    error of the compiled hook's summed gradients against the compiled DDP's
    (error feedback makes the sum, not each pass, close) and against the
    eager hook's, this rank's gradients per pass, and the hook's routes."""
    g, comm = _group(world)
    if rank >= world:
        return {}
    torch._dynamo.reset()  # every case compiles afresh: no graph of another case's model
    # DDP's default buckets: DDPOptimizer wants the first no larger than the
    # others, which a tiny cap breaks.
    plain = torch.compile(DDP(make_model("mlp"), process_group=g))
    # Exact top-k: the sampled mode draws its sample with the communicator's
    # call count, which the two hooks' interleaved calls advance for each other.
    kw = {"codec": pycomm.TopK(0.25, exact=True)} if hook == "topk" else {}
    ours_ddp = DDP(make_model("mlp"), process_group=g)
    state = _state(hook, comm, "auto", g, **kw)
    ours_ddp.register_comm_hook(state, HOOKS[hook])
    ours = torch.compile(ours_ddp)
    eager = DDP(make_model("mlp"), process_group=g)
    eager_state = _state(hook, comm, "auto", g, **kw)
    eager.register_comm_hook(eager_state, HOOKS[hook])
    gen = torch.Generator().manual_seed(4000 + rank)
    sums = {}
    per_iter = []
    for _ in range(iters):
        x, y = make_batch("mlp", gen)
        for name, m, module in (("plain", plain, plain._orig_mod.module), ("ours", ours, ours_ddp.module),
                                ("eager", eager, eager.module)):
            for p in module.parameters():
                p.grad = None
            torch.nn.functional.mse_loss(m(x), y).backward()
            gr = _grads(module)
            sums[name] = gr.clone() if name not in sums else sums[name] + gr
            if name == "ours":
                per_iter.append(gr.clone())

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    return {"vs_compiled_ddp": rel(sums["ours"], sums["plain"]), "vs_eager_hook": rel(sums["ours"], sums["eager"]),
            "grads": per_iter, "routes": state.routes(), "iterations": state.iteration}
