"""The CUDA operators against the CPU ones, on a GPU (``@pytest.mark.cuda``;
skipped without one).

Both sides share the per-element math (kernels/quant.h, kernels/reduce.h) and
build without fused multiply-adds, so payloads, residuals and reductions must
agree bit for bit: a payload quantized on a GPU decodes to the same values on
a CPU rank and back.
"""
import pytest
import torch

from group_cases import mismatches, same_bits
from test_compression_kernels import REDUCE_DTYPES, rand_blocks, reduce_inputs

pytestmark = pytest.mark.cuda

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
OPS = torch.ops.pycomm


def offset_on_gpu(t):
    """t's copy on the GPU one element into a larger tensor: contiguous, but
    not where the warp kernels' runs of elements may start (they take one
    element a lane there)."""
    return None if t is None else torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")[1:].copy_(t)


def codec_matches_cpu(x, r, r_gpu, bits, block, stochastic, acc_seed, offset=False):
    """Quantizes x (with residual r on the CPU, its copy r_gpu on the GPU) on
    both devices and checks payloads, residuals, the decoded values in every
    dtype and dequantize-accumulate bit for bit (x, and the accumulator, one
    element off on the GPU with `offset`); returns both payloads."""
    n = x.numel()
    p_cpu = OPS.quantize(x, bits, block, stochastic, 7, r)
    p_gpu = OPS.quantize(offset_on_gpu(x) if offset else x.cuda(), bits, block, stochastic, 7, r_gpu)
    assert same_bits(p_cpu, p_gpu), (n, "payload")
    assert same_bits(r, r_gpu), (n, "residual")
    for out_dtype in FLOATS:
        assert same_bits(OPS.dequantize(p_cpu, n, bits, block, out_dtype),
                         OPS.dequantize(p_gpu, n, bits, block, out_dtype)), (n, out_dtype)
    acc = rand_blocks(n, block, acc_seed, x.dtype)
    acc_gpu = offset_on_gpu(acc) if offset else acc.cuda()
    OPS.dequantize_accumulate(acc, p_cpu, bits, block)
    OPS.dequantize_accumulate(acc_gpu, p_gpu, bits, block)
    assert same_bits(acc, acc_gpu), (n, "accumulate")
    return p_cpu, p_gpu


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
# Blocks of 64-512 take the warp-per-block kernels, others (40, 1024) the block-wide ones.
@pytest.mark.parametrize("bits,block,stochastic", [(8, 256, False), (8, 64, True), (4, 128, False), (4, 256, True),
                                                   (8, 512, True), (4, 64, False), (8, 1024, False), (4, 40, True)])
def test_quantize_and_error_feedback_match_cpu(dtype, bits, block, stochastic):
    """Whole and cut blocks, the tensors aligned as allocated (runs of
    elements a lane) and one element off (one element a lane)."""
    for i, (n, offset) in enumerate([(1, False), (block - 3, False), (100003, False), (100003, True),
                                     (block - 3, True)]):
        x = rand_blocks(n, block, 10 + i, dtype)
        r = torch.randn(n, generator=torch.Generator().manual_seed(i)) * 0.01
        r_gpu = offset_on_gpu(r) if offset else r.cuda()
        codec_matches_cpu(x, r, r_gpu, bits, block, stochastic, 99, offset)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits,block", [(8, 256), (4, 256), (8, 64), (4, 512)])
def test_dequantize_matches_cpu_at_any_alignment(dtype, bits, block):
    """Outputs that start one element off their allocation take the
    one-element-a-lane kernel, the others the kernel of runs of 4 (2 at
    blocks of 64); odd counts cut a block's last run. Payloads one byte off go
    through an aligned copy (a misaligned scale read faulted on an H200 and
    poisoned the process's CUDA context). Quantizing into such a payload
    writes the CPU's bytes and nothing past them."""
    for n in (1, block - 1, 100003):
        p_cpu = OPS.quantize(rand_blocks(n, block, n, dtype), bits, block, False, 0, None)
        for p_off in (0, 1):
            p_gpu = torch.zeros(p_cpu.numel() + p_off, dtype=torch.uint8, device="cuda")[p_off:]
            p_gpu.copy_(p_cpu)
            for o_off in (0, 1):
                want = rand_blocks(n, block, 7, dtype)
                got = torch.zeros(n + o_off, dtype=dtype, device="cuda")[o_off:]
                got.copy_(want)
                OPS.dequantize_accumulate(want, p_cpu, bits, block)
                OPS.dequantize_accumulate(got, p_gpu, bits, block)
                assert same_bits(want, got), (n, p_off, o_off, "accumulate")
                OPS.dequantize_into(want, p_cpu, bits, block)
                OPS.dequantize_into(got, p_gpu, bits, block)
                assert same_bits(want, got), (n, p_off, o_off)
            x = rand_blocks(n, block, 8, dtype)
            into = torch.full((p_cpu.numel() + p_off + 3,), 7, dtype=torch.uint8, device="cuda")
            OPS.quantize_into(x.cuda(), into[p_off:p_off + p_cpu.numel()], bits, block, False, 0, None, 0)
            assert same_bits(into[p_off:p_off + p_cpu.numel()], OPS.quantize(x, bits, block, False, 0, None, 0))
            assert bool((into[p_off + p_cpu.numel():] == 7).all()), (n, p_off, "past the payload")


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("bits,block", [(8, 256), (4, 128), (8, 512), (4, 64), (8, 40)])
def test_nan_and_inf_blocks_match_cpu(dtype, bits, block):
    """Blocks holding NaN or Inf (flagged: their codes carry them exactly)
    take their own branch in the warp kernels, decided once per block; every
    other block the finite one. Payloads, residuals and decoded values as the
    CPU kernels', whole and cut blocks alike."""
    n = 7 * block + block // 2
    x = rand_blocks(n, block, 21, dtype)
    g = torch.Generator().manual_seed(22)
    for value in (float("nan"), float("inf"), float("-inf")):
        x[torch.randint(0, n, (5,), generator=g)] = value
    x[6 * block + 3] = float("nan")  # the last whole block
    x[n - 1] = float("inf")  # the cut block
    r = torch.randn(n, generator=g) * 0.01
    r_gpu = r.cuda()
    p_cpu, p_gpu = codec_matches_cpu(x, r, r_gpu, bits, block, False, 23)
    other = OPS.quantize(rand_blocks(n, block, 24), bits, block, False, 0, None)
    s = torch.zeros(n)
    s_gpu = s.cuda()
    cpu = OPS.dequant_reduce_requant([p_cpu, other], None, n, bits, block, 0.5, False, 0, s)
    gpu = OPS.dequant_reduce_requant([p_gpu, other.cuda()], None, n, bits, block, 0.5, False, 0, s_gpu)
    assert same_bits(cpu, gpu) and same_bits(s, s_gpu)


# 9 sources at blocks of 64 and 5 at 256 take the fused kernel's groups of
# sources whole and cut; 1 source, no dense addend and no residual its
# shortest form.
@pytest.mark.parametrize("bits,block,sources", [(8, 256, 5), (4, 256, 4), (8, 40, 5), (4, 512, 3), (8, 64, 9),
                                                (4, 128, 1)])
@pytest.mark.parametrize("dense_and_residual", [True, False, "offset"])
def test_dequant_reduce_requant_matches_cpu(bits, block, sources, dense_and_residual):
    """("offset": the dense addend and the residual one element off on the
    GPU, which takes one element a lane.)"""
    n = 70001
    payloads = [OPS.quantize(rand_blocks(n, block, s), bits, block, False, 0, None) for s in range(sources)]
    dense = torch.randn(n, generator=torch.Generator().manual_seed(5)) if dense_and_residual else None
    r = torch.randn(n, generator=torch.Generator().manual_seed(6)) * 0.01 if dense_and_residual else None
    on_gpu = offset_on_gpu if dense_and_residual == "offset" else (lambda t: None if t is None else t.cuda())
    r_gpu = on_gpu(r)
    scale = 0.2 if dense_and_residual else 1.0
    cpu = OPS.dequant_reduce_requant(payloads, dense, n, bits, block, scale, True, 11, r)
    gpu = OPS.dequant_reduce_requant([p.cuda() for p in payloads], on_gpu(dense), n, bits, block, scale, True, 11,
                                     r_gpu)
    assert same_bits(cpu, gpu)
    if r is not None:
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
    idx_off = (cap * x.element_size() + 7) // 8 * 8  # this call's capacity, not the exact one's
    idx = buf.cpu()[idx_off:idx_off + 4 * kept].view(torch.int32).long()
    kth = x.float().abs().topk(k).values[-1]
    assert (x.float().abs()[idx] >= 0.9 * kth).float().mean() > 0.99


def _sampled_chunks(n: int, stride: int) -> torch.Tensor:
    """The chunks of 256 that CUDA top-k's sample takes, one in each group of
    ``stride`` (csrc/kernels/topk_sample.h's hash, written again here)."""
    mask64, chunks = (1 << 64) - 1, (n + 255) // 256
    out = []
    for g in range((chunks + stride - 1) // stride):
        z = (g + 0x9E3779B97F4A7C15) & mask64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask64
        z ^= z >> 31
        out.append(g * stride + z % min(stride, chunks - g * stride))
    return torch.tensor(out)


@pytest.mark.parametrize("case", ["even", "sample-low", "sample-high", "rows"])
def test_sampled_topk_from_a_sample_of_chunks_or_the_whole_tensor(case):
    """At 4M elements and k = 1 %, sampled top-k picks its threshold from one
    chunk of 256 elements in 4, and checks it on the whole tensor. With the
    sampled chunks scaled (sample-low, sample-high), the sample's threshold
    misses the window, and the selection starts over on the whole tensor.
    Rows of 1024 columns whose first 256 are 8x the rest (a gradient's
    structure) are sampled without bias. Either way it keeps every key above
    a threshold and none below, k to k (1 + tolerance) of them."""
    n, tol = 1 << 22, 0.1
    k = n // 100
    x = torch.randn(n, generator=torch.Generator().manual_seed(31))
    if case == "rows":
        x.view(-1, 1024)[:, :256] *= 8
    elif case != "even":
        scaled = torch.zeros(n // 256, dtype=torch.bool)
        scaled[_sampled_chunks(n, 4)] = True
        x.view(-1, 256)[scaled] *= 0.5 if case == "sample-low" else 2.0
    buf, kept, cap = OPS.topk(x.cuda(), k, False, tol, 0.01, 0, None)
    assert k <= kept <= cap == int(k * (1 + tol)), (kept, cap)
    off = (cap * x.element_size() + 7) // 8 * 8
    idx = buf.cpu()[off:off + 4 * kept].view(torch.int32).long()
    assert bool((idx[1:] > idx[:-1]).all()), "indices ascending"
    mask = torch.zeros(n, dtype=torch.bool)
    mask[idx] = True
    assert x.abs()[mask].min() >= x.abs()[~mask].max()


@pytest.mark.parametrize("n", [3001, 1 << 20])
@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_topk_with_many_ties_matches_cpu(dtype, n):
    """Eleven distinct values: the k-th magnitude has ~n/11 ties, of which the lowest indices complete the
    k (counted per range of the tensor on the GPU). Exact: the CPU's indices. Sampled never settles on such
    data and falls back to the exact cut: the same indices."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-5, 6, (n,), generator=g).to(dtype)
    k = n // 100

    def indices(buf, kept, cap):
        off = (cap * x.element_size() + 7) // 8 * 8
        return buf.cpu()[off:off + 4 * kept].view(torch.int32).sort().values

    exact_c = indices(*OPS.topk(x, k, True, 0.1, 0.01, 0, None))
    exact_g = indices(*OPS.topk(x.cuda(), k, True, 0.1, 0.01, 0, None))
    sampled_g = indices(*OPS.topk(x.cuda(), k, False, 0.1, 0.01, 0, None))
    assert exact_c.numel() == k and torch.equal(exact_g, exact_c)
    assert torch.equal(sampled_g, exact_c)


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


# CUDA kernels reduce the dtypes the hooks and the IPC all-reduce send, with sum, avg, max and min.
@pytest.mark.parametrize("dtype", [d for d in REDUCE_DTYPES if d not in (torch.int8, torch.bool)], ids=str)
def test_reduce_matches_cpu(dtype):
    ops = ["sum", "max", "min"] + (["avg"] if dtype.is_floating_point else [])
    for i, (nsrc, n) in enumerate([(2, 1), (3, 4099), (8, 1 << 20)]):
        xs = reduce_inputs(dtype, nsrc, n, 50 + i)
        for op in ops:
            assert same_bits(OPS.reduce(xs, op), OPS.reduce([x.cuda() for x in xs], op)), (op, nsrc, n)
    # Misaligned views take the element-wise path.
    xs = reduce_inputs(dtype, 3, 4097, 60)
    assert same_bits(OPS.reduce([x[1:] for x in xs], "sum"), OPS.reduce([x.cuda()[1:] for x in xs], "sum"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", [(1, 7, 1), (5, 3000, 4), (64, 96, 32), (2, 100000, 2)])
def test_orthogonalize_matches_cpu(dtype, shape):
    """Same order of operations, double sums: equal to the CPU's within the
    rounding of the block-wise sums' order."""
    m = torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    cpu, gpu = m.clone(), m.cuda()
    OPS.orthogonalize_(cpu, 0.0)
    OPS.orthogonalize_(gpu, 0.0)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert (gpu.cpu() - cpu).abs().max().item() <= tol * shape[2]


def test_mixed_devices_are_refused():
    with pytest.raises(RuntimeError, match="is on cpu but the input is on cuda"):
        OPS.reduce([torch.randn(8).cuda(), torch.randn(8)], "sum")


def test_quantized_ipc_group_of_one_rank_fused_equals_split():
    """A group of one rank (what kernels.py times and Nsight Compute
    profiles): the fused kernel's three steps meet no peer, and its results
    and residuals over 3 steps with error feedback are the kernels per
    step's bits, aligned and one element off (an aligned copy), on a grid of
    3 blocks and on the GPU's."""
    import pycomm
    from torch.distributed import HashStore

    def group(kind, blocks=None):
        return pycomm.cuda_ipc.IpcAllReduce(HashStore(), 0, 1, device="cuda:0", buffer_bytes=4 << 20, prefix=kind,
                                            quantized_kernels=kind, timeout=30, fused_blocks=blocks)

    split = group("split")
    for fused in (group("fused"), group("fused", 3)):
        for codec, dtype, n in ((pycomm.Int8(), torch.float32, 300007), (pycomm.Int4(block=128), torch.bfloat16, 4099),
                                (pycomm.Int8(block=512, stochastic=True), torch.float16, 70001)):
            ef_a, ef_b = pycomm.compression.ErrorFeedback(), pycomm.compression.ErrorFeedback()
            for step in range(3):
                x = rand_blocks(n, codec.block, 50 + step, dtype).cuda()
                a = x.clone() if step != 1 else offset_on_gpu(x.cpu())
                b = x.clone()
                fused.all_reduce(a, op="avg", compression=codec, error_feedback=ef_a, key="k")
                split.all_reduce(b, op="avg", compression=codec, error_feedback=ef_b, key="k")
                assert not mismatches(step, a, b, ef_a, ef_b), (fused.fused_blocks, codec, step)
        fused.check()
    split.check()


@pytest.fixture(scope="module")
def gpu_pool():
    from harness import RankPool

    pool = RankPool(4)
    yield pool
    pool.close()


@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("world", [2, 4])
def test_ipc_all_reduce_on_one_gpu_matches_the_cpu_reduction(gpu_pool, world, double_buffer):
    """Every rank on GPU 0 (NCCL refuses this): the result is the CPU kernel's reduction of every rank's input
    in rank order, bit for bit, on every rank, for one-shot and two-shot, tails, several launches per call, a
    misaligned output and a misaligned tensor reduced in place; in a single- and a double-buffered group."""
    from collective_cases import make_input
    from cuda_cases import IPC_CASES, run_ipc

    per_rank = gpu_pool.run(run_ipc, world, gpu_pool.new_name(), IPC_CASES, double_buffer, world=world)
    for i, (dtype, op, n, algo) in enumerate(IPC_CASES):
        exp = OPS.reduce([make_input(i, q, n, dtype) for q in range(world)], op)
        for r in range(world):
            for k in (3 * i, 3 * i + 1, 3 * i + 2):
                assert same_bits(per_rank[r][k], exp), (dtype, op, n, algo, r, k)


@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("world", [2, 4])
def test_ipc_all_reduce_replays_from_a_cuda_graph(gpu_pool, world, double_buffer):
    """One-shot, two-shot and auto captured in one graph, replayed on fresh
    inputs with eager calls in between: the CPU reduction's bits every time.
    Ring, tree (async) and the compressed call refuse capture with a message,
    and the group works after it."""
    from cuda_cases import run_ipc_graph

    per_rank = gpu_pool.run(run_ipc_graph, world, gpu_pool.new_name(), double_buffer=double_buffer, world=world)
    for rank, res in enumerate(per_rank):
        assert not res["bad"], f"rank {rank}:\n" + "\n".join(res["bad"])
        ring, tree, int8 = res["refusals"]
        assert "schedules" in ring and "CUDA graph" in ring, ring
        assert "schedules" in tree and "CUDA graph" in tree, tree
        assert "quantized" in int8 and "CUDA graph" in int8, int8


@pytest.mark.parametrize("kernels", ["fused", "split"])
@pytest.mark.parametrize("double_buffer", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("world", [2, 4])
def test_ipc_calls_of_every_kind_back_to_back_never_overwrite_what_a_peer_reads(gpu_pool, world, double_buffer,
                                                                              kernels):
    """80 calls drawn at random (the same on every rank): one-shot, two-shot,
    auto, ring, tree, int8 and CUDA graph replays, sizes from 1 element to
    several launches, each result checked: the barriers between calls (and
    the one a double-buffered group leaves out) hold whatever comes next."""
    from cuda_cases import run_ipc_mixed

    per_rank = gpu_pool.run(run_ipc_mixed, world, gpu_pool.new_name(), double_buffer, kernels, world=world)
    for rank, bad in enumerate(per_rank):
        assert not bad, f"rank {rank}: " + "; ".join(bad[:10])


def test_ipc_all_reduce_is_stream_ordered_and_async(gpu_pool):
    from cuda_cases import run_ipc_async

    out = gpu_pool.run(run_ipc_async, 2, gpu_pool.new_name(), world=2)
    for res in out:
        assert torch.equal(res["y"], torch.full((1 << 20,), 6.0)), res["y"][:4]
        assert torch.equal(res["z"], torch.full((1 << 20,), 4.0)), res["z"][:4]
        assert torch.equal(res["s"], torch.full((1 << 20,), 6.0)), res["s"][:4]
        assert res["future_is_x"] and res["done"]
        assert all(("without storage of its own" if i % 2 == 0 else "lazy negative") in why
                   for i, why in enumerate(res["refused"])), res["refused"]
        assert torch.equal(res["after"], torch.full((4096,), 3.0))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_ipc_schedules_equal_the_cpu_executor_bit_for_bit(gpu_pool, world):
    """Ring, tree and direct run by the device executor on GPU 0: the CPU
    communicator's bits with the same algorithm and round size, every dtype the
    kernel takes, sum/avg/max/min, counts 0, 1, primes, several rounds, in place
    and into a misaligned view; interleaved with the hand-written kernels."""
    from cuda_cases import run_schedules

    per_rank = gpu_pool.run(run_schedules, world, gpu_pool.new_name(), world=world)
    for rank, bad in enumerate(per_rank):
        assert not bad, f"rank {rank}: {len(bad)} mismatches:\n" + "\n".join(bad[:20])


@pytest.mark.parametrize("kernels", ["fused", "fused_small", "split"])
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ipc_quantized_all_reduce_equals_the_cpu_communicator(gpu_pool, world, kernels):
    """Int8/Int4 (round-to-nearest and stochastic, blocks of 64-512, and 96,
    which only the kernel-per-step form takes) through the peers' buffers, as
    one fused kernel (on the grid the GPU fits, and on 3 blocks, the least
    the ranks' fused_blocks asked for) and as a kernel per step:
    outputs, worker and server residuals bit for bit the CPU communicator's
    over 3 steps with error feedback, at sizes that leave some thread blocks
    without work and some with several batches, and on outputs not aligned
    for runs of elements every other step (offset views: the fused kernel
    takes aligned copies); bad calls refused with a message (max, top-k, float64,
    codes larger than the buffer)."""
    from cuda_cases import run_ipc_quantized

    cases = [(codec, n, dtype, op)
             for codec in ("int8", "int8_b64_stoch", "int4", "int4_stoch", "int8_b96", "int4_b512")
             for n, dtype, op in ((70001, torch.float32, "avg"), (1021, torch.bfloat16, "sum"),
                                  (4099, torch.float16, "avg"), (1, torch.float32, "sum"),
                                  (300007, torch.bfloat16, "avg"))]
    per_rank = gpu_pool.run(run_ipc_quantized, world, gpu_pool.new_name(), cases, world=world, kernels=kernels)
    for rank, res in enumerate(per_rank):
        *bad, msgs = res
        for case, b in zip(cases, bad):
            assert not b, (rank, case, b)
        assert "sums or averages" in msgs[0] and "Int8() or pycomm.Int4()" in msgs[1], msgs
        assert "compression takes" in msgs[2] and "larger buffer_bytes" in msgs[3], msgs


@pytest.mark.parametrize("mode", ["kill", "silent"])
def test_ipc_survivors_raise_when_a_peer_dies_or_stays_silent(tmp_path, mode):
    """Fresh processes on GPU 0; in each kind of IPC call (one-shot, two-shot,
    ring, tree, quantized int8), while the survivors' kernels wait for it, a
    peer is killed with SIGKILL (its death is seen by the watchdog: the
    survivors raise within 5 s although the timeout is 60 s) or stays alive
    and never calls (the survivors give up after their 3 s timeout). Every
    later call raises too; nothing of pycomm's is left in /dev/shm (the
    multiprocessing queue's own semaphores go when it is collected)."""
    import multiprocessing

    from cuda_cases import DEATH_KINDS, ipc_peer_dies
    from reliability_cases import shm_entries

    world = 2 + len(DEATH_KINDS)
    shm_before = shm_entries()
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=ipc_peer_dies, args=(r, world, str(tmp_path / "store"), mode, results))
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=120) for _ in range(2 * len(DEATH_KINDS))]
        for p in procs:
            p.join(timeout=60)
    finally:  # a hang must not leave processes spinning on the GPU
        for p in procs:
            if p.is_alive():
                p.kill()
    assert sorted((kind, rank) for kind, rank, *_ in got) == sorted(
        (kind, rank) for kind in DEATH_KINDS for rank in (0, 1)), got
    for kind, rank, err, took, later in got:
        assert err and "gave up" in err, (kind, rank, err)
        if mode == "kill":
            assert "is gone" in err and took < 5.0, (kind, rank, err, took)
        else:
            # (the wait that gives up first may be on a survivor that itself waits for the silent rank)
            assert "waited more than the timeout for rank" in err and 2.5 < took < 20.0, (kind, rank, err, took)
        assert later and "cannot be used" in later or "aborted" in (later or ""), (kind, rank, later)
    assert all(p.exitcode == (-9 if mode == "kill" else 0) for p in procs[2:]), [p.exitcode for p in procs]
    assert all(p.exitcode == 0 for p in procs[:2]), [p.exitcode for p in procs]
    assert shm_entries() <= shm_before, shm_entries() - shm_before


# ---------------------------------------------------------------- hooks and the group path on CUDA


@pytest.fixture(scope="module")
def ddp_pool():
    """4 ranks on GPU 0 with a default Gloo group (NCCL refuses several ranks on one GPU), subgroups of 2 and 4."""
    import hooks_cases
    from harness import RankPool

    pool = RankPool(4)
    pool.run(hooks_cases.init_default, 4, pool.new_name("cudahooks"))
    yield pool
    pool.close()


@pytest.mark.parametrize("world", [2, 4])
def test_group_path_on_cuda_equals_the_cpu_bits(ddp_pool, world):
    from cuda_cases import group_cuda_versus_cpu

    cases = [(codec, n, dtype, op) for codec in ("int8", "int8_b64_stoch", "int4", "int4_stoch", "topk",
                                                "topk_sampled")
             for n, dtype, op in ((70001, torch.float32, "avg"), (1021, torch.bfloat16, "sum"),
                                  (4099, torch.float16, "avg"))]
    per_rank = ddp_pool.run(group_cuda_versus_cpu, world, cases)[:world]
    for r, bad in enumerate(per_rank):
        for i, (case, b) in enumerate(zip(cases, bad)):
            if case[0] == "topk_sampled":  # digests: every rank the same bits
                assert b == per_rank[0][i], (r, case)
            else:
                assert not b, (r, case, b)


def test_group_path_on_cuda_returns_before_the_gpu_is_done(ddp_pool):
    from cuda_cases import group_cuda_does_not_block

    for res in ddp_pool.run(group_cuda_does_not_block, 2)[:2]:
        assert res["gpu_s"] > 0.05 and res["returned_s"] < 0.1 * res["gpu_s"], res
        assert torch.allclose(res["y"], torch.full((1 << 16,), 4.0), atol=0.02), res["y"][:4]


CUDA_BOUNDS = {"allreduce": 1e-6, "bf16": 1e-2, "int8": 2e-2, "int4": 0.25, "topk": 0.8, "powersgd": 0.6}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("option", ["bucket_view", "static_graph", "no_sync"])
@pytest.mark.parametrize("hook", ["allreduce", "bf16", "int8", "int4", "topk", "local_sgd", "powersgd"])
def test_every_hook_on_cuda_buckets(ddp_pool, hook, option, world):
    """DDP on CUDA models (every rank on GPU 0) with each hook under each DDP
    option, against DDP without a hook; the policy's paths: compressed
    buckets the group path, plain ones the group's all-reduce (ranks share a
    GPU, so not IPC)."""
    import hooks_cases

    res = ddp_pool.run(hooks_cases.compose, world, hook, option, device="cuda")[:world]
    for rank in range(world):
        assert res[rank]["finite"], rank
        if hook == "local_sgd":
            continue
        assert res[rank]["rel_err"] <= CUDA_BOUNDS[hook], (rank, res[rank]["rel_err"])
        for a, b in zip(res[rank]["grads"], res[0]["grads"]):
            assert torch.equal(a, b), f"rank {rank}'s averaged gradients differ from rank 0's"
        assert set(res[rank]["routes"].values()) == {"group"}, res[rank]["routes"]


@pytest.mark.parametrize("hook", ["topk", "powersgd", "stale"])
def test_an_overflow_step_on_cuda_buckets_leaves_no_trace(ddp_pool, hook):
    """tests/test_hooks.py's overflow case on CUDA buckets (the group path):
    PowerSGD decides on the device, without reading the verdict back."""
    import overflow_cases

    res = ddp_pool.run(overflow_cases.overflow_step, 2, hook, device="cuda")[:2]
    bad = overflow_cases.OVERFLOW_STEP + (1 if hook == "stale" else 0)
    for rank in range(2):
        assert res[rank]["finite"] == [step != bad for step in range(len(res[rank]["finite"]))], res[rank]
        assert torch.isfinite(res[rank]["params"]).all()
        assert torch.equal(res[rank]["params"], res[0]["params"])


@pytest.mark.parametrize("wire,fragments,overlap", [("plain", 1, False), ("bf16", 3, True), ("int8", 3, False),
                                                     ("int4", 1, True)])
def test_diloco_on_cuda_follows_the_closed_form(ddp_pool, wire, fragments, overlap):
    """pycomm.DiLoCo with CUDA parameters (the group path) on the quadratic
    whose every rank's path is known in float64, as tests/test_diloco.py."""
    import diloco_cases
    from test_diloco import BOUNDS

    res = ddp_pool.run(diloco_cases.quadratic, 4, wire, fragments, overlap, device="cuda")
    for r in res:
        assert r["worst"] <= BOUNDS[wire], (wire, r["worst"])
    assert all(torch.equal(r["final"], res[0]["final"]) for r in res)


@pytest.mark.parametrize("wire,overlap", [("plain", 0), ("int8", 2)])
def test_diloco_on_cuda_keeps_the_global_model_on_the_cpu_when_asked(ddp_pool, wire, overlap):
    """backup_device="cpu": the global parameters and the outer momentum in
    pinned host memory, the pseudo-gradients formed and averaged on the GPU;
    the same path as without it (the quadratic's float64 simulation)."""
    import diloco_cases
    from test_diloco import BOUNDS

    res = ddp_pool.run(diloco_cases.quadratic, 4, wire, 3, overlap, device="cuda", backup_device="cpu")
    for r in res:
        assert r["worst"] <= BOUNDS[wire] and r["kept_on"] == ["cpu"] and r["pinned"], r
    assert all(torch.equal(r["final"], res[0]["final"]) for r in res)


@pytest.mark.parametrize("fused", [False, True])
def test_diloco_on_cuda_keeps_its_schedule_when_grad_scaler_skips(ddp_pool, fused):
    """GradScaler("cuda") skips an overflowing inner step on one rank; the
    step counts, every rank syncs at the same steps (fused SGD: skipped in its
    own kernel)."""
    import diloco_cases

    res = ddp_pool.run(diloco_cases.grad_scaler, 4, 3, True, fused, False, device="cuda")
    for r in res:
        assert r["local_step"] == 20 and r["worst"] <= 1e-5, r
    assert all(torch.equal(r["final"], res[0]["final"]) for r in res)


@pytest.mark.parametrize("world", [2, 4])
def test_every_path_s_future_orders_a_reader_on_another_stream(ddp_pool, world):
    """200 calls per path, each result waited on and read at once on another
    stream than the input's (which a sleep keeps busy): every read sees the
    whole result, with no device-wide synchronize anywhere (the plain group
    path's futures were not CUDA-aware before: StaleState needed one)."""
    from cuda_cases import read_at_once_from_another_stream

    for rank, wrong in enumerate(ddp_pool.run(read_at_once_from_another_stream, world)[:world]):
        assert wrong == {"group plain": 0, "group compressed": 0, "ipc": 0}, (rank, wrong)


@pytest.mark.parametrize("hook", ["allreduce", "bf16", "int8", "int4"])
def test_cuda_buckets_through_ipc_when_asked(ddp_pool, hook):
    """path='ipc': plain buckets through the IPC kernels, Int8/Int4 ones through
    the quantized IPC all-reduce (with error feedback)."""
    import hooks_cases

    res = ddp_pool.run(hooks_cases.compose, 2, hook, "bucket_view", path="ipc", device="cuda")[:2]
    for rank in range(2):
        assert set(res[rank]["routes"].values()) == {"ipc"}, res[rank]["routes"]
        assert ("cuda/compressed" in res[rank]["routes"]) == (hook in ("int8", "int4")), res[rank]["routes"]
        assert res[rank]["rel_err"] <= CUDA_BOUNDS[hook], (rank, res[rank]["rel_err"])
        for a, b in zip(res[rank]["grads"], res[0]["grads"]):
            assert torch.equal(a, b)


@pytest.mark.parametrize("hook", ["allreduce", "int8", "powersgd", "stale"])
def test_sparse_cuda_gradients_take_the_group_path(ddp_pool, hook):
    """An nn.EmbeddingBag(sparse=True) on CUDA under each hook: its gradient
    goes through the group's own sparse all-reduce (Gloo's here) and equals
    DDP's without a hook, as on the CPU."""
    import hooks_cases

    res = ddp_pool.run(hooks_cases.sparse_embedding, 2, hook, "auto", "cuda")[:2]
    for rank in range(2):
        assert res[rank]["sparse"] and res[rank]["dense_finite"], res[rank]
        assert res[rank]["diff"] <= 1e-5, (rank, res[rank])
        assert res[rank]["routes"].get("cuda/sparse") == "group", res[rank]


def test_cuda_digits_convergence_with_int8_and_topk(ddp_pool):
    """4 ranks on GPU 0: int8 within 0.5 and top-k 1 % within 2 accuracy points of DDP without a hook, as on CPU."""
    import hooks_cases

    base = ddp_pool.run(hooks_cases.digits_accuracy, 4, None, 500, device="cuda")
    int8 = ddp_pool.run(hooks_cases.digits_accuracy, 4, "int8", 500, 0, device="cuda")
    topk = ddp_pool.run(hooks_cases.digits_accuracy, 4, "topk", 500, 10, 0.01, device="cuda")
    for accs in (base, int8, topk):
        assert len(set(accs)) == 1
    assert base[0] > 95, base
    assert abs(int8[0] - base[0]) <= 0.5, (base[0], int8[0])
    assert base[0] - topk[0] <= 2.0, (base[0], topk[0])


@pytest.mark.parametrize("wire", ["plain", "bf16", "int8", "int4", "topk"])
def test_stale_hook_on_cuda_buckets(ddp_pool, wire):
    """Staleness 1 on CUDA models (2 ranks on GPU 0): the closed form, the
    same bits on every rank, every wire format on the policy's path; each
    backward starts behind a GPU sleep, so the gradients are written after
    the hook handed back the stale average, unless it waits for them."""
    import straggler_cases
    from test_straggler import check_stale

    res = ddp_pool.run(straggler_cases.stale_closed_form, 2, 1, wire, 5, True, device="cuda", busy_gpu=True)[:2]
    check_stale(res, 1, 5, wire)
    assert set(res[0]["routes"].values()) == {"group"}, res[0]["routes"]


@pytest.fixture(scope="module")
def ft_zygote():
    import ft_ddp_cases
    import reliability_cases

    z = reliability_cases.Zygote()  # it never touches CUDA: its forked ranks may
    z.run(ft_ddp_cases.preload)
    yield z
    z.close()


@pytest.mark.parametrize("hook", ["allreduce", "int8", "stale1"])
def test_fault_tolerant_ddp_on_cuda_survives_kill_9(ft_zygote, hook):
    """FaultTolerantDDP on a CUDA model, 4 ranks: a process group per
    membership epoch (NCCL with a GPU per rank; Gloo, through host memory,
    where they share one); kill -9 at a random step and moment; the
    survivors finish every step, bitwise identical, within a point of the
    same training without a death."""
    import ft_ddp_cases as fc
    from test_ft_ddp import STEPS, check

    base = ft_zygote.run(fc.kill_during_training, hook, 4, STEPS, 0, deaths=0, device="cuda", timeout=300)
    check(base, f"cuda baseline {hook}", 4, deaths=0, hook=hook)
    res = ft_zygote.run(fc.kill_during_training, hook, 4, STEPS, 71 + fc.HOOKS.index(hook), device="cuda",
                        timeout=300)
    where = f"cuda {hook}, killed {res['kills']}"
    check(res, where, 4, hook=hook)
    gpus = torch.cuda.device_count()
    for r, rep in res["reports"].items():
        assert set(rep["routes"].values()) == {"group"} and set(rep["routes"]) <= {"cuda/plain", "cuda/compressed"}, \
            (where, rep["routes"])
        assert rep["cuda_backend"] == ("nccl" if gpus >= 4 else "gloo"), (where, rep["cuda_backend"], gpus)
        assert rep["acc"] >= base["reports"][0]["acc"] - 1.0, (where, r, rep["acc"])
