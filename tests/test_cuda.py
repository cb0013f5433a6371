"""The CUDA operators against the CPU ones, on a GPU (``@pytest.mark.cuda``;
skipped without one).

Both sides share the per-element math (kernels/quant.h, kernels/reduce.h) and
build without fused multiply-adds, so payloads, residuals and reductions must
agree bit for bit: a payload quantized on a GPU decodes to the same values on
a CPU rank and back.
"""
import pytest
import torch

from test_compression_kernels import REDUCE_DTYPES, rand_blocks, reduce_inputs

pytestmark = pytest.mark.cuda

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
OPS = torch.ops.pycomm


def same_bits(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu().view(torch.uint8),
                                                                      b.cpu().view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits,block,stochastic", [(8, 256, False), (8, 64, True), (4, 128, False), (4, 256, True)])
def test_quantize_and_error_feedback_match_cpu(dtype, bits, block, stochastic):
    for i, n in enumerate([1, block - 3, 100003]):
        x = rand_blocks(n, block, 10 + i, dtype)
        r = torch.randn(n, generator=torch.Generator().manual_seed(i)) * 0.01
        r_gpu = r.cuda()
        p_cpu = OPS.quantize(x, bits, block, stochastic, 7, r)
        p_gpu = OPS.quantize(x.cuda(), bits, block, stochastic, 7, r_gpu)
        assert same_bits(p_cpu, p_gpu), (n, "payload")
        assert same_bits(r, r_gpu), (n, "residual")
        for out_dtype in FLOATS:
            assert same_bits(OPS.dequantize(p_cpu, n, bits, block, out_dtype),
                             OPS.dequantize(p_gpu, n, bits, block, out_dtype))
        acc = rand_blocks(n, block, 99, dtype)
        acc_gpu = acc.cuda()
        OPS.dequantize_accumulate(acc, p_cpu, bits, block)
        OPS.dequantize_accumulate(acc_gpu, p_gpu, bits, block)
        assert same_bits(acc, acc_gpu)


@pytest.mark.parametrize("bits", [8, 4])
def test_dequant_reduce_requant_matches_cpu(bits):
    n, block = 70001, 256
    payloads = [OPS.quantize(rand_blocks(n, block, s), bits, block, False, 0, None) for s in range(5)]
    dense = torch.randn(n, generator=torch.Generator().manual_seed(5))
    r = torch.zeros(n)
    r_gpu = r.cuda()
    cpu = OPS.dequant_reduce_requant(payloads, dense, n, bits, block, 0.2, True, 11, r)
    gpu = OPS.dequant_reduce_requant([p.cuda() for p in payloads], dense.cuda(), n, bits, block, 0.2, True, 11,
                                     r_gpu)
    assert same_bits(cpu, gpu)
    assert same_bits(r, r_gpu)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_topk_matches_cpu(dtype):
    n = 1 << 20
    x = rand_blocks(n, 4096, 3, dtype)
    k = n // 100
    buf_c, kept_c, cap_c = OPS.topk(x, k, True, 0.1, 0.01, 0, None)
    buf_g, kept_g, cap_g = OPS.topk(x.cuda(), k, True, 0.1, 0.01, 0, None)
    assert (kept_c, cap_c) == (kept_g, cap_g) == (k, cap_c)
    idx_off = (cap_c * x.element_size() + 7) // 8 * 8
    idx_c = buf_c[idx_off:idx_off + 4 * kept_c].view(torch.int32).sort().values
    idx_g = buf_g.cpu()[idx_off:idx_off + 4 * kept_g].view(torch.int32).sort().values
    assert torch.equal(idx_c, idx_g)
    # Threshold-sampled: at least k, within the capacity, every kept entry at least the k-th magnitude's 90 %.
    buf, kept, cap = OPS.topk(x.cuda(), k, False, 0.1, 0.01, 0, None)
    assert k <= kept <= cap
    idx = buf.cpu()[idx_off:idx_off + 4 * kept].view(torch.int32).long()
    kth = x.float().abs().topk(k).values[-1]
    assert (x.float().abs()[idx] >= 0.9 * kth).float().mean() > 0.99


def test_scatter_add_matches_cpu_and_rejects_bad_indices():
    n = 100000
    dense = torch.randn(n)
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:5000].to(torch.int32)
    vals = torch.randn(5000, dtype=torch.float16)
    dense_gpu = dense.cuda()
    OPS.scatter_add(dense, vals, idx)
    OPS.scatter_add(dense_gpu, vals.cuda(), idx.cuda())
    assert same_bits(dense, dense_gpu)
    bad = idx.clone()
    bad[7] = n
    with pytest.raises(RuntimeError, match="outside"):
        OPS.scatter_add(dense_gpu, vals.cuda(), bad.cuda())


@pytest.mark.parametrize("dtype", REDUCE_DTYPES, ids=str)
def test_reduce_matches_cpu(dtype):
    ops = ["sum", "max", "min"] + (["avg"] if dtype.is_floating_point else [])
    for i, (nsrc, n) in enumerate([(2, 1), (3, 4099), (8, 1 << 20)]):
        xs = reduce_inputs(dtype, nsrc, n, 50 + i)
        for op in ops:
            assert same_bits(OPS.reduce(xs, op), OPS.reduce([x.cuda() for x in xs], op)), (op, nsrc, n)
    # Misaligned views take the element-wise path.
    xs = reduce_inputs(dtype, 3, 4097, 60)
    assert same_bits(OPS.reduce([x[1:] for x in xs], "sum"), OPS.reduce([x.cuda()[1:] for x in xs], "sum"))


def test_mixed_devices_are_refused():
    with pytest.raises(RuntimeError, match="is on cpu but the input is on cuda"):
        OPS.reduce([torch.randn(8).cuda(), torch.randn(8)], "sum")


@pytest.fixture(scope="module")
def gpu_pool():
    from harness import RankPool

    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("world", [2, 4])
def test_ipc_all_reduce_on_one_gpu_matches_the_cpu_reduction(gpu_pool, world):
    """Every rank on GPU 0 (NCCL refuses this): the result is the CPU kernel's reduction of every rank's input
    in rank order, bit for bit, on every rank, for one-shot and two-shot, tails, several launches per call and
    a misaligned output."""
    from collective_cases import make_input
    from cuda_cases import IPC_CASES, run_ipc

    per_rank = gpu_pool.run(run_ipc, world, gpu_pool.new_name(), IPC_CASES, world=world)
    for i, (dtype, op, n, algo) in enumerate(IPC_CASES):
        exp = OPS.reduce([make_input(i, q, n, dtype) for q in range(world)], op)
        for r in range(world):
            for k in (2 * i, 2 * i + 1):
                assert same_bits(per_rank[r][k], exp), (dtype, op, n, algo, r, k)


def test_ipc_all_reduce_refuses_graph_capture(gpu_pool):
    from cuda_cases import run_ipc_graph_capture

    msgs = gpu_pool.run(run_ipc_graph_capture, 2, gpu_pool.new_name(), world=2)
    assert all("CUDA graph" in m for m in msgs), msgs


def test_ipc_all_reduce_is_stream_ordered_and_async(gpu_pool):
    from cuda_cases import run_ipc_async

    out = gpu_pool.run(run_ipc_async, 2, gpu_pool.new_name(), world=2)
    for res in out:
        assert torch.equal(res["y"], torch.full((1 << 20,), 6.0)), res["y"][:4]
        assert torch.equal(res["z"], torch.full((1 << 20,), 4.0)), res["z"][:4]
        assert res["future_is_x"] and res["done"]
