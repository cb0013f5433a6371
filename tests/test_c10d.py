"""pycomm as a torch.distributed backend: the collective matrix through
dist.* calls, every call the backend serves, DDP equal to Gloo's, a
torchrun-launched script, and a clean exit when the store's host leaves first."""
import inspect
import os
import re
import subprocess
import sys

import pytest
import torch

import c10d_cases
import c10d_layout_cases
from collective_cases import matrix_failures
from harness import RankPool

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(8)
    assert pool.run(c10d_cases.init_default, 8, pool.new_name("c10d")) == ["cpu:pycomm"] * 8
    yield pool
    pool.close()


# The foundation's matrix for every world size through the tuner, and each
# forced algorithm on one odd world size.
MATRIX = [(w, coll, "auto") for w in (1, 2, 3, 5, 8) for coll in ("all_reduce", "reduce_scatter", "all_gather",
                                                                    "broadcast")]
MATRIX += [(3, "all_reduce", a) for a in ("ring", "tree", "direct")] + [(3, "broadcast", "tree")]


@pytest.mark.parametrize("world,coll,algo", MATRIX)
def test_matrix_through_torch_distributed(pool, world, coll, algo):
    per_rank = pool.run(c10d_cases.matrix, world, coll, algo)[:world]
    failures = matrix_failures(per_rank)
    assert not failures, f"{len(failures)} failing cases of {len(per_rank[0])}:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_call_the_backend_serves(pool, world):
    results = pool.run(c10d_cases.api, world)[:world]
    for rank, res in enumerate(results):
        assert res.pop("backend") == "pycomm"
        premul = res.pop("PREMUL_SUM")
        assert premul.startswith("CommError") and "PREMUL_SUM takes float16" in premul, (rank, premul)
        failed = [k for k, ok in res.items() if ok is not True]
        assert not failed, f"rank {rank}: {failed}"


@pytest.mark.parametrize("world", [2, 3])
def test_every_dtype_and_reduce_op(pool, world):
    """Copies move every dtype bit for bit; reductions take Gloo's dtypes
    with every op (PRODUCT and the bitwise ones included), closed form."""
    for rank, res in enumerate(pool.run(c10d_cases.dtypes, world)[:world]):
        assert res["failures"] == [], (rank, res["failures"])
        assert res["checked"] >= 200, res["checked"]
        assert res["usable"], rank
        for what, err in res["refusals"].items():
            assert err.startswith("CommError"), (rank, what, err)
        assert "op=band needs an integral or bool tensor" in res["refusals"]["band float32"]
        assert "op=avg needs a floating-point tensor" in res["refusals"]["avg int32"]
        assert "reductions take" in res["refusals"]["sum int16"]



@pytest.mark.parametrize("world", [2, 3])
def test_premul_sum_scales_each_rank_s_input(pool, world):
    """ReduceOp.PREMUL_SUM (NCCL's scaled sum; FSDP2 uses it for a gradient
    divide factor, and Gloo refuses it) through all_reduce, reduce, both
    reduce-scatters and both coalesced calls: each rank's input times its own
    factor (a number or a one-element tensor), then SUM, bit for bit; inputs
    the call does not write stay as they were. Integral tensors and a complex
    factor are refused on every rank, naming the problem (torch itself
    refuses PREMUL_SUM without a factor)."""
    for rank, res in enumerate(pool.run(c10d_cases.premul_sum, world)[:world]):
        assert res["failures"] == [], (rank, res["failures"])
        assert res["checked"] == 4 * 2 * 9, res["checked"]  # dtypes x factor kinds x checks
        assert res["usable"], rank
        ref = res["refusals"]
        assert ref["int64"].startswith("CommError") and "takes float16, bfloat16, float32 and float64" in ref["int64"]
        assert "one real element" in ref["complex factor"], ref["complex factor"]


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_that_are_not_contiguous(pool, world):
    """Transposed, channels_last and strided views, and layouts that differ
    between ranks, give exact results in every single-tensor collective (a
    contiguous copy carries them; Gloo reads their memory as if contiguous);
    an expanded output is refused on every rank and the group goes on."""
    for rank, res in enumerate(pool.run(c10d_layout_cases.layouts, world)[:world]):
        refused = res.pop("expanded output")
        assert refused.startswith("CommError") and "share memory" in refused, (rank, refused)
        failed = [k for k, ok in res.items() if ok is not True]
        assert not failed and len(res) == 15, (rank, res)

def test_ddp_with_a_bool_buffer(pool):
    """DDP's constructor broadcasts buffers of every dtype; its logging names the backend."""
    world = 3
    results = pool.run(c10d_cases.ddp_bool_buffer, world)[:world]
    for rank, (mask, count, grad, logged) in enumerate(results):
        assert torch.equal(mask, torch.arange(6) % 2 == 0), (rank, mask)  # rank 0's mask everywhere
        assert count.item() == 0 and count.dtype == torch.int16
        assert torch.equal(grad, results[0][2])
        assert logged == "pycomm"


@pytest.mark.parametrize("per_call", [False, True], ids=["group timeout", "barrier(timeout=)"])
def test_timeouts_speak_torchs_words(pool, per_call):
    """A barrier only rank 0 enters: a DistBackendError saying "Timed out waiting 1000ms", naming the
    rank, after 1 s, whether the group's timeout or the call's own says so."""
    import torch.distributed as dist

    if per_call and "timeout" not in inspect.signature(dist.barrier).parameters:
        pytest.skip("this torch's dist.barrier takes no timeout= (torch 2.11's does not)")
    err, waited = pool.run(c10d_cases.timeout_words, 3, per_call)[0]
    assert err.startswith("CommError") and "Timed out waiting 1000ms" in err and "rank 1" in err, err
    assert 0.9 < waited < 10, waited  # not the group's 60 s
    import pycomm

    assert issubclass(pycomm.CommError, dist.DistBackendError) and issubclass(pycomm.CommError, RuntimeError)


def test_mismatch_raises_on_every_rank(pool):
    for rank, err in enumerate(pool.run(c10d_cases.mismatch, 3)[:3]):
        assert err.startswith("CommError") and "disagree" in err, (rank, err)


# torch's hooks, and pycomm's own (their communicator built on the group).
@pytest.mark.parametrize("hook", [None, "allreduce", "fp16", "pycomm", "pycomm-int8"])
def test_ddp_matches_gloo(pool, hook):
    world = 4
    ours = pool.run(c10d_cases.ddp_train, world, "pycomm", hook)[:world]
    gloo = pool.run(c10d_cases.ddp_train, world, "gloo", hook)[:world]
    for rank in range(world):
        for a, b in zip(ours[rank], ours[0]):
            assert torch.equal(a, b), f"rank {rank} parameters differ from rank 0's"
    # Same data, same averaging; only the order of the float sums differs.
    tol = dict(rtol=1e-3, atol=1e-4) if hook == "fp16" else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(ours[0], gloo[0]):
        assert torch.allclose(a, b, **tol), (a - b).abs().max()


def _run(cmd, timeout=180):
    env = dict(os.environ, TORCH_CPP_LOG_LEVEL="ERROR", OMP_NUM_THREADS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=HERE)


def test_torchrun_script():
    p = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
              os.path.join(HERE, "c10d_script.py"), "train"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(re.findall(r"OK rank \d+", p.stdout)) == [f"OK rank {r}" for r in range(3)], p.stdout


def test_store_host_leaves_first():
    """Rank 0 hosts the TCPStore and exits right after its last collective;
    the others destroy their group afterwards and still exit cleanly."""
    p = _run([sys.executable, os.path.join(HERE, "c10d_script.py"), "host-leaves-first", "3"])
    assert p.returncode == 0, p.stdout + p.stderr
    assert sorted(re.findall(r"OK rank \d+", p.stdout)) == [f"OK rank {r}" for r in range(3)], p.stdout
    for bad in ("terminate called", "Segmentation", "core dumped", "Traceback"):
        assert bad not in p.stderr, p.stderr


def test_backend_registers_only_the_devices_the_communicator_takes(monkeypatch):
    """A CUDA build must not register "cuda": the communicator takes CPU tensors
    only, whatever the build, and says so (tests/test_errors.py checks the words)."""
    import torch.distributed as dist

    import pycomm
    from pycomm import c10d

    assert c10d.devices() == list(pycomm.load_core().collective_devices) == ["cpu"]
    assert dist.Backend.backend_capability["pycomm"] == ["cpu"]

    class CudaBuild:  # what a CUDA build of the core reports
        has_cuda = True
        collective_devices = ("cpu",)

    monkeypatch.setattr(c10d, "load_core", lambda: CudaBuild)
    assert c10d.devices() == ["cpu"]
