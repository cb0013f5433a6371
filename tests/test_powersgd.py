"""PowerSGD: the fused orthogonalization against float64 Gram-Schmidt, the
hook against torch's powerSGD_hook on the same buckets and against a float64
reference of the algorithm, DDP's options, checkpoints, digits convergence
and bad arguments."""
import os

import pytest
import torch

import hooks_cases
import powersgd_cases
from harness import RankPool
from pycomm import hooks


LONG = os.environ.get("PYCOMM_LONG") == "1"


@pytest.fixture(scope="module")
def pool():
    pool = RankPool(4)
    assert pool.run(hooks_cases.init_default, 4, pool.new_name("powersgd")) == ["gloo"] * 4
    yield pool
    pool.close()


# ---------------------------------------------------------------- the operator


def _mgs64(m: torch.Tensor) -> torch.Tensor:
    return torch.stack([powersgd_cases._mgs(x) for x in m.double()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(1, 7, 1), (5, 300, 4), (3, 64, 64), (2, 1000, 2)])
def test_orthogonalize_matches_float64_gram_schmidt(dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    m = torch.randn(*shape, generator=gen).to(dtype)
    want = _mgs64(m)
    got = hooks.orthogonalize_(m.clone())
    tol = 1e-12 if dtype == torch.float64 else 2e-5 * shape[2]
    assert (got.double() - want).abs().max().item() <= tol
    eye = torch.eye(shape[2], dtype=torch.float64)
    assert (got.double().transpose(1, 2) @ got.double() - eye).abs().max().item() <= 10 * tol


def test_orthogonalize_edge_cases():
    m = torch.randn(40, 3)
    m[:, 1] = 0  # a layer without gradient: stays zero instead of turning into NaN
    out = hooks.orthogonalize_(m.clone())
    assert out.isfinite().all() and torch.equal(out[:, 1], torch.zeros(40))
    assert torch.allclose(out[:, 0].norm(), torch.tensor(1.0))
    eps = hooks.orthogonalize_(torch.full((4, 1), 2.0), epsilon=1.0)  # col / (|col| + eps)
    assert torch.allclose(eps, torch.full((4, 1), 2.0 / 5.0))
    strided = torch.randn(3, 16, 8)[:, :, ::2]  # not contiguous: orthogonalized through a copy
    assert torch.allclose(hooks.orthogonalize_(strided.clone()), _mgs64(strided).float(), atol=1e-5)
    half = torch.randn(2, 32, 2).to(torch.bfloat16)
    assert torch.allclose(hooks.orthogonalize_(half.clone()).float(), _mgs64(half.float()).float(), atol=2e-2)


@pytest.mark.parametrize("bad,match", [
    (torch.randn(3, 4), "columns must not outnumber rows"),
    (torch.randn(10), "2 or 3 dimensions"),
    (torch.ones(8, 2, dtype=torch.int32), "float32 or float64"),
])
def test_orthogonalize_rejects_what_it_cannot_do(bad, match):
    with pytest.raises(RuntimeError, match=match):
        torch.ops.pycomm.orthogonalize_(bad, 0.0)


# ---------------------------------------------------------------- the hook


@pytest.mark.parametrize("path", ["auto", "group"])
@pytest.mark.parametrize("matrix_rank,batch", [(1, False), (4, False), (4, True)])
def test_same_math_as_torchs_powersgd_hook(pool, matrix_rank, batch, path):
    """4 ranks, one bucket (torch's hook hangs on Gloo with several), two
    plain iterations and four compressed ones with error feedback and warm start: pycomm's hook gives torch's
    averages to float32 rounding (torch orthogonalizes rank > 2 by QR, whose
    column signs differ; P Q^T does not see them)."""
    res = pool.run(powersgd_cases.torch_parity, 4, matrix_rank, batch, path)
    for r in res:
        assert max(r["rel"]) < 2e-4, r["rel"]
        assert r["ratio"] > 1.5, r["ratio"]
        assert r["routes"]["cpu/compressed"] == ("communicator" if path == "auto" else "group"), r["routes"]
    assert all(torch.equal(r["grads"], res[0]["grads"]) for r in res), "ranks hold different averages"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("matrix_rank,batch", [(1, False), (4, True)])
def test_same_math_as_torchs_powersgd_hook_in_half_precision(pool, matrix_rank, batch, dtype):
    """A model cast to bfloat16 / float16: the same averages as torch's hook
    to a few roundings of that dtype. Both keep P, Q and the residual in the
    bucket's dtype; they round differently (pycomm sums in float32 and rounds
    once, Gloo sums in the dtype; pycomm orthogonalizes 16-bit factors in
    float32), and error feedback carries each step's rounding into the next
    (measured: at most 3 epsilons of the dtype over 6 steps)."""
    res = pool.run(powersgd_cases.torch_parity, 4, matrix_rank, batch, dtype=dtype)
    for r in res:
        assert max(r["rel"]) < 6 * torch.finfo(dtype).eps, r["rel"]
        assert r["grads"].dtype == dtype and bool(r["grads"].isfinite().all())
    assert all(torch.equal(r["grads"], res[0]["grads"]) for r in res), "ranks hold different averages"


@pytest.mark.parametrize("world,matrix_rank", [(2, 1), (2, 3), (4, 4)])
def test_against_a_float64_reference_of_the_algorithm(pool, world, matrix_rank):
    for r in pool.run(powersgd_cases.reference, world, matrix_rank)[:world]:
        assert r["worst"] < 1e-4, r


@pytest.mark.parametrize("option", ["bucket_view", "static_graph", "no_sync"])
def test_composes_with_ddp_options(pool, option):
    res = pool.run(hooks_cases.compose, 2, "powersgd", option)[:2]
    for r in res:
        assert r["finite"]
        # Two plain steps and one rank-2 step of random gradients: the sum
        # keeps most of the signal (error feedback keeps the rest for later).
        assert r["rel_err"] < 0.6, r["rel_err"]
    for a, b in zip(res[0]["grads"], res[1]["grads"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("wire,via", [("plain", "state_dict"), ("int8", "state_dict"), ("plain", "pickle"),
                                      ("int8", "pickle")])
def test_checkpoint_resumes_the_same_training(pool, wire, via):
    """Saved at step 4, resumed in a fresh DDP (whose first iteration has
    another bucket layout, so residuals and factors go back per parameter).
    Plain factors: the same parameters bit for bit. int8 factors: their
    quantization blocks follow the layout of that first step, so close, and
    much closer than a resume without the hook's state. The checkpoint holds
    ``state.state_dict()`` or the pickled state itself (torch's way)."""
    for r in pool.run(powersgd_cases.checkpoint, 2, wire, via)[:2]:
        assert r["iteration"] == 6
        if via == "pickle":
            assert r["unpickled"] == ("PowerSGDState", 2, 2, "None" if wire == "plain" else
                                      "Int8(block=256, stochastic=False, seed=0)", 4), r
        assert not r["without"], r
        if wire == "plain":
            assert r["with"], r
        else:
            assert r["with_diff"] < 0.25 * r["without_diff"], r


def test_digits_within_a_point_of_synchronous_training(pool, digits_baseline):
    """4 ranks, 500 steps on scikit-learn's digits: PowerSGD rank 4 (plain;
    and with int8 factors under PYCOMM_LONG=1) within 1 accuracy point of DDP
    without a hook."""
    base = digits_baseline(pool, 4, 500)
    for hook in ("powersgd4", "powersgd4-int8") if LONG else ("powersgd4",):
        accs = pool.run(hooks_cases.digits_accuracy, 4, hook, 500, 10)
        assert len(set(accs)) == 1, accs
        assert base[0] - accs[0] <= 1.0, (hook, base[0], accs[0])


def test_staleness_hands_back_last_steps_average(pool):
    for r in pool.run(powersgd_cases.stale_equals_delayed, 2)[:2]:
        assert r["first_zero"] and all(r["same"]), r


@pytest.mark.skipif(not LONG, reason="PYCOMM_LONG=1: two more digits trainings")
def test_composes_with_staleness_on_digits(pool, digits_baseline):
    """StaleState(wire=PowerSGD(4)): 4 ranks on digits at lr 0.05 (the
    staleness-1 recipe), within 1 point of synchronous training at that rate."""
    base = digits_baseline(pool, 4, 500, lr=0.05)
    accs = pool.run(hooks_cases.digits_accuracy, 4, "stale1-powersgd4", 500, lr=0.05)
    assert len(set(accs)) == 1, accs
    assert base[0] - accs[0] <= 1.0, (base[0], accs[0])


def test_bad_states_say_what_to_do():
    import pycomm

    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        hooks.PowerSGDState(rank=0, communicator=object())
    with pytest.raises(ValueError, match="start_iter must be >= 2"):
        hooks.PowerSGDState(start_iter=1)
    with pytest.raises(TypeError, match="Int8"):
        hooks.PowerSGDState(wire=pycomm.TopK(0.01))
    with pytest.raises(TypeError, match="PowerSGDState"):
        hooks.powersgd_hook(hooks.AllReduceState(), None)
