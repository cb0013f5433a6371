"""Compressed all-reduce (Int8, Int4, TopK) on 1-8 ranks against float64.

Bounds checked per element (RTN = round to nearest, SR = stochastic):
  what a rank sends:  |x_r - sent_r| <= c * scale_r          (c = 1/2 RTN, 1 SR)
  the result:         |out - post * sum_r sent_r| <= c * scale_out
with scale = absmax(block) / qmax, post = 1/world for avg. TopK sends the
selected entries exactly: out == post * sum_r sent_r up to float32 summation.
Every rank must get the same bits, and the bytes on the wire must shrink.
"""
import dataclasses
import pickle

import pytest
import torch

import pycomm

from collective_cases import EPS, make_input
from compressed_cases import run_bad_calls, run_cases, run_error_feedback, run_mismatch

QMAX = {"int8": 127, "int4": 7}
COUNTS = [0, 1, 7, 1021, 16411, 70001]


def block_absmax(v: torch.Tensor, block: int) -> torch.Tensor:
    n = v.numel()
    pad = (-n) % block
    a = torch.nn.functional.pad(v.abs(), (0, pad)).view(-1, block).max(1).values
    return a.repeat_interleave(block)[:n]


def codec_params(name):
    bits = "int8" if name.startswith("int8") else "int4"
    block = 64 if "b64" in name else (128 if name == "int4" else 256)
    return QMAX[bits], block, (1.0 if "stoch" in name else 0.5)


def check_case(case, per_rank, world):
    seed, codec, n, dtype, op = case
    post = 1.0 / world if op == "avg" else 1.0
    outs = [r["out"] for r in per_rank]
    assert len({r["digest"] for r in per_rank}) == 1, "ranks disagree bitwise"
    out = outs[0].double()
    xs = [make_input(seed, r, n, dtype).double() for r in range(world)]
    sents = [r["sent"].double() for r in per_rank]
    if n == 0:
        return
    if codec.startswith("topk"):
        ratio = 0.05 if codec == "topk" else 0.02
        k = max(1, round(ratio * n))
        for x, s in zip(xs, sents):
            nnz = int((s != 0).sum())
            kept = torch.zeros(n, dtype=torch.bool)
            kept[s != 0] = True
            assert torch.equal(s[kept], x[kept].to(dtype).double()), "sent values are the inputs"
            if codec == "topk-exact":
                assert nnz == min(k, n)
                ref = torch.topk(x.abs(), min(k, n)).values
                assert torch.allclose(s[kept].abs().sort().values, ref.sort().values)
            else:
                assert k <= nnz <= 1.1 * k + 1, (nnz, k)
                exact_mass = torch.topk(x.abs(), min(k, n)).values.pow(2).sum()
                assert s.pow(2).sum() >= 0.95 * exact_mass
        exp = post * torch.stack(sents).sum(0)
        tol = world * 2.0 ** -23 * torch.stack(sents).abs().sum(0) + EPS[dtype] * exp.abs() + 1e-30
        assert ((out - exp).abs() <= tol).all()
        return
    qmax, block, c = codec_params(codec)
    slack = 2.0 ** -20
    for x, s in zip(xs, sents):
        scale = block_absmax(x, block) / qmax
        assert ((x - s).abs() <= c * scale + slack * x.abs()).all(), "a rank's quantization exceeds its bound"
    ssum = post * torch.stack(sents).sum(0)
    scale_out = block_absmax(ssum, block) / qmax
    err = (out - ssum).abs()
    bound = c * scale_out * (1 + 1e-5) + slack * ssum.abs() + EPS[dtype] * ssum.abs() + 1e-30
    assert (err <= bound).all(), f"{codec} {n}: max excess {(err - bound).max().item()}"
    # End to end against the exact reduction.
    exact = post * torch.stack(xs).sum(0)
    in_scales = sum(block_absmax(x, block) / qmax for x in xs)
    bound = c * post * in_scales + c * scale_out * (1 + 1e-5) + 2 * slack * exact.abs() + EPS[dtype] * exact.abs()
    assert ((out - exact).abs() <= bound + 1e-30).all()


def cases_for(world):
    cases = []
    seed = world * 1000
    for codec in ("int8", "int8-b64-stoch", "int4", "int4-stoch", "topk", "topk-exact"):
        for n in COUNTS:
            for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg"), (torch.float16, "avg")):
                if dtype != torch.float32 and n not in (1021, 16411):
                    continue
                seed += 1
                cases.append((seed, codec, n, dtype, op))
    return cases


@pytest.mark.parametrize("world", list(range(1, 9)))
def test_compressed_all_reduce_matrix(pool8, world):
    cases = cases_for(world)
    per_rank = pool8.run(run_cases, world, pool8.new_name(), cases, world=world)
    failures = []
    for i, case in enumerate(cases):
        try:
            check_case(case, [res[i] for res in per_rank], world)
        except AssertionError as e:
            failures.append(f"{case[1]} n={case[2]} {case[3]} {case[4]}: {e}")
        stats = per_rank[0][i]
        if world > 1 and case[2] >= 16411:
            assert stats["bytes_sent"] < stats["bytes_uncompressed"], (case, stats)
        if world == 1:
            assert stats["bytes_sent"] == 0
    assert not failures, "\n".join(failures[:15])


def test_compression_ratio_on_the_wire(pool8):
    """Int8 sends ~1/4, Int4 ~1/8 of the plain all-reduce's bytes (plus scales); TopK(0.05) on 2 ranks ~1/9."""
    n = 1 << 18
    cases = [(1, "int8", n, torch.float32, "sum"), (2, "int4", n, torch.float32, "sum"),
             (3, "topk", n, torch.float32, "sum")]
    per_rank = pool8.run(run_cases, 2, pool8.new_name(), cases, world=2)
    ratios = [per_rank[0][i]["bytes_sent"] / per_rank[0][i]["bytes_uncompressed"] for i in range(3)]
    assert 0.25 < ratios[0] < 0.27, ratios
    assert 0.125 < ratios[1] < 0.14, ratios
    assert 0.10 < ratios[2] < 0.12, ratios


@pytest.mark.parametrize("codec", ["int8", "int4", "topk"])
@pytest.mark.parametrize("world", [2, 5])
def test_error_feedback_conserves_the_sum_across_ranks(pool8, codec, world):
    """sum_t out_t + post * sum_r worker_r + server (at its shard) == post * sum_t sum_r x_{r,t}."""
    n, steps = 9001, 6
    per_rank = pool8.run(run_error_feedback, world, pool8.new_name(), codec, n, steps, world=world)
    post = 1.0 / world
    total = per_rank[0]["total"]
    acc = total.clone()
    exact = torch.zeros(n, dtype=torch.float64)
    for r in range(world):
        acc += post * per_rank[r]["worker"].double()
        for t in range(steps):
            exact += post * make_input(1000 + t, r, n, torch.float32).double()
        if per_rank[r]["server"] is not None:
            shard = per_rank[r]["shard"]
            lo, hi = r * shard, min(n, (r + 1) * shard)
            if hi > lo:
                acc[lo:hi] += per_rank[r]["server"][: hi - lo].double()
    scale = exact.abs().max().item() + 1
    assert (acc - exact).abs().max().item() <= steps * world * 8 * 2.0 ** -24 * scale
    assert (total - exact).abs().max().item() > 1e-4  # compression did drop something each step
    assert per_rank[0]["stats"]["compressed_calls"] == steps


def test_bad_calls_raise_everywhere_and_leave_the_communicator_usable(pool8):
    per_rank = pool8.run(run_bad_calls, 3, pool8.new_name(), world=3)
    expected = ["multiple of 8", "op=sum and op=avg", "ratio must be in", "float32, float16 or bfloat16",
                "is not a codec", "cannot be combined", "needs compression="]
    for msgs in per_rank:
        for want, got in zip(expected, msgs):
            assert want in got, (want, got)
        assert msgs[-1] == "after: 3.0"


@pytest.mark.parametrize("make,words", [
    (lambda: pycomm.Int8(block=12), "Int8(block=12): block must be a multiple of 8"),
    (lambda: pycomm.Int4(block=0), "Int4(block=0): block must be a multiple of 8"),
    (lambda: pycomm.Int8(block=1 << 21), "between 8 and 1048576"),
    (lambda: pycomm.TopK(ratio=0.0), "ratio must be in (0, 1]"),
    (lambda: pycomm.TopK(ratio=1.5), "ratio must be in (0, 1]"),
    (lambda: pycomm.TopK(ratio=float("nan")), "ratio must be in (0, 1]"),
    (lambda: pycomm.TopK(tolerance=1.0), "tolerance must be in [0, 1)"),
    (lambda: pycomm.TopK(sample_fraction=0.0), "sample_fraction must be in (0, 1]"),
    (lambda: dataclasses.replace(pycomm.Int4(), block=7), "block must be a multiple of 8"),
])
def test_a_bad_codec_fails_where_it_is_built(make, words):
    with pytest.raises(ValueError) as e:
        make()
    assert words in str(e.value)


def test_good_codecs_build_and_travel():
    for codec in (pycomm.Int8(block=8), pycomm.Int4(block=1 << 20, stochastic=True), pycomm.TopK(ratio=1.0),
                  pycomm.TopK(ratio=1e-6, exact=True, tolerance=0.0, sample_fraction=1.0)):
        assert pickle.loads(pickle.dumps(codec)) == codec


def test_codec_mismatch_raises_on_every_rank(pool8):
    per_rank = pool8.run(run_mismatch, 3, pool8.new_name(), world=3)
    for msg in per_rank:
        assert "disagree" in msg or "rank 0" in msg, msg


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_all_to_all_single(pool8, world):
    """Block p of rank r's input lands as block r of rank p's output (uint8 too: payloads travel as bytes)."""
    from compressed_cases import run_all_to_all

    for n, dtype in ((0, torch.float32), (1, torch.uint8), (5003, torch.float32), (70001, torch.uint8)):
        outs = pool8.run(run_all_to_all, world, pool8.new_name(), n, dtype, world=world)
        for p in range(world):
            for r in range(world):
                expect = make_input(77, r, world * n, dtype)[p * n:(p + 1) * n]
                assert torch.equal(outs[p][r * n:(r + 1) * n], expect), (world, n, dtype, p, r)
