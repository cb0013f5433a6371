"""pycomm-bench end to end: the table, JSON rows, the plot, torchrun, bad options."""
import json
import os
import socket
import subprocess
import sys

import pytest
import torch

import pycomm

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
KEYS = {"collective", "backend", "algorithm", "dtype", "size_bytes", "nranks", "time_us", "algbw_gbps",
        "busbw_gbps", "wrong"}


def bench(*args, launcher=(sys.executable, "-m", "pycomm.bench"), timeout=300):
    return subprocess.run([*launcher, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


def test_sweep_table_json_and_plot(tmp_path):
    out, png = tmp_path / "rows.json", tmp_path / "plot.png"
    r = bench("--nproc", "2", "-b", "1K", "-e", "256K", "-f", "16", "--json", str(out), "--plot", str(png),
              "--bind-cores")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "size(B)" in r.stdout and "busbw(GB/s)" in r.stdout and "#wrong" in r.stdout
    assert "cores bound: rank 0 on [" in r.stdout, r.stdout  # --bind-cores, said in the header
    rows = json.loads(out.read_text())
    sizes = sorted({row["size_bytes"] for row in rows})
    assert sizes == [1024, 16384, 262144]
    for size in sizes:
        labels = {row["algorithm"] for row in rows if row["size_bytes"] == size}
        assert labels == {"ring", "tree", "direct", "auto", "gloo"}, labels
    for row in rows:
        assert KEYS <= set(row), set(row)
        assert row["wrong"] == 0 and row["nranks"] == 2 and row["time_us"] > 0
        # nccl-tests' all-reduce factor 2(n-1)/n is 1 for two ranks.
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])
        if row["backend"] == "pycomm":
            assert row["speedup_vs_baseline"] > 0
    assert png.stat().st_size > 10_000


def test_other_collectives_under_torchrun(tmp_path):
    """Three collectives in one torchrun launch (-c takes a list): a table
    each, every row checked, busbw by each collective's factor; no torch
    deprecation warning among the rows (torch 2.13 renamed the flat forms)."""
    out = tmp_path / "rows.json"
    colls = ["reduce_scatter", "all_gather", "broadcast"]
    r = bench("-c", ",".join(colls), "-b", "4K", "-e", "64K", "-f", "16", "-d", "bfloat16", "--json", str(out),
              launcher=(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                        "-m", "pycomm.bench"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "FutureWarning" not in r.stderr, r.stderr[-2000:]
    assert [line.split(",")[0] for line in r.stdout.splitlines() if line.startswith("# pycomm-bench: ")] == \
        [f"# pycomm-bench: {c}" for c in colls], r.stdout
    rows = json.loads(out.read_text())
    assert {row["nranks"] for row in rows} == {3}
    assert all(row["wrong"] == 0 for row in rows)
    for coll in colls:
        mine = [row for row in rows if row["collective"] == coll]
        # 4K and 64K (whole blocks per rank), pycomm's algorithms and gloo's row at each.
        assert len({row["size_bytes"] for row in mine}) == 2, coll
        assert {row["backend"] for row in mine} == {"pycomm", "gloo"}, coll
        factor = 1.0 if coll == "broadcast" else 2 / 3
        for row in mine:
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * factor)
        assert ("tree" in {row["algorithm"] for row in mine}) == (coll == "broadcast"), coll
        # The summary compares each collective with its own baseline.
        best = [line for line in r.stdout.splitlines() if line.startswith(f"# {coll} ") and ": best " in line]
        assert len(best) == 2 and all("gloo" in line for line in best), r.stdout


# A rank as torchrun starts one; once the benchmark returned, it lists the
# threads still running (Linux names them): a process group that outlived
# destroy_process_group still has its Gloo and store threads.
RANK_SCRIPT = r"""
import os, sys
from pycomm.bench.cli import main
main(sys.argv[1:])
tasks = os.listdir("/proc/self/task")
print("THREADS", *sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks), flush=True)
"""


def test_in_place_rows(tmp_path):
    """--in-place: NCCL's in-place forms (a reduce-scatter's output in its
    input, an all-gather's input in its output) for pycomm's algorithms,
    registered buffers, the pycomm backend and the baseline, 3 ranks; every
    row checked; all-to-all (no in-place form) stays out of place."""
    out = tmp_path / "rows.json"
    r = bench("--nproc", "3", "-c", "reduce_scatter,all_gather,all_to_all", "-a", "ring,direct,auto,c10d", "-b",
              "4K", "-e", "64K", "-f", "16", "--registered", "--in-place", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    heads = [line for line in r.stdout.splitlines() if line.startswith("# pycomm-bench: ")]
    assert [", in place," in h for h in heads] == [True, True, False], heads
    rows = [row for row in json.loads(out.read_text()) if row["backend"] != "memcpy"]
    assert {row["backend"] for row in rows} == {"pycomm", "gloo"}
    for row in rows:
        assert row["wrong"] == 0, row
        assert row["in_place"] == (row["collective"] != "all_to_all"), row
    assert {row["algorithm"] for row in rows if row["collective"] == "reduce_scatter"} >= {"ring+reg", "c10d", "gloo"}


def test_deepspeed_row_checks_its_sums_and_leaves_no_segment_nor_group(tmp_path):
    pytest.importorskip("deepspeed", reason="the --deepspeed row needs DeepSpeed (pip install deepspeed)")
    out = tmp_path / "rows.json"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    # The segments' names carry the port: only this run's are looked for.
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2", "PYTHONFAULTHANDLER": "1"}
    args = ["-b", "4K", "-e", "64K", "-f", "16", "-a", "auto", "--no-baseline", "--deepspeed", "--json", str(out)]
    ranks = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, *args], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)})
             for r in range(2)]
    outputs = [p.communicate(timeout=600)[0] for p in ranks]
    for p, text in zip(ranks, outputs):
        assert p.returncode == 0, text
    rows = [row for row in json.loads(out.read_text()) if row["backend"] == "deepspeed"]
    assert {row["size_bytes"] for row in rows} == {4096, 65536} and all(row["wrong"] == 0 for row in rows)
    # DeepSpeed leaves its shared-memory segments behind (~64 MB a rank, kept
    # in memory by /dev/shm); the benchmark unlinks them once every rank mapped them.
    left = [f for f in os.listdir("/dev/shm") if f.startswith("deepspeed_allreduce_buffer_") and f"_{port}_" in f]
    assert left == [], left
    # DeepSpeed imported after init_process_group would hold the group into
    # the interpreter's exit, where it aborted the process 1 run in ~15 under
    # load (a Gloo worker thread needing the GIL then): load() comes first.
    for text in outputs:
        threads = next(line.split()[1:] for line in text.splitlines() if line.startswith("THREADS"))
        assert not [t for t in threads if "gloo" in t or "tcpstore" in t], threads


def test_all_to_all_rows_check_every_block(tmp_path):
    out = tmp_path / "rows.json"
    r = bench("--nproc", "3", "-c", "all_to_all", "-b", "1K", "-e", "64K", "-f", "64", "-d", "int64",
              "-a", "ring,c10d", "--registered", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    assert {row["label"] for row in rows} == {"direct", "direct+reg", "c10d", "gloo", "memcpy (each rank)"}
    for row in rows:
        assert row["wrong"] == 0 and row["nranks"] == 3
        if row["backend"] != "memcpy":
            # nccl-tests' size: the send buffer, a whole number of blocks per rank.
            assert row["size_bytes"] % (3 * 8) == 0
            assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 / 3)


def test_compressed_rows_are_checked_against_each_codec_s_bound(tmp_path):
    out = tmp_path / "rows.json"
    r = bench("--nproc", "3", "-b", "4K", "-e", "256K", "-f", "64", "-d", "bfloat16", "-o", "avg", "-a", "auto",
              "--compression", "int8,int4:64:stochastic,topk:0.02,topk:0.01:exact", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(out.read_text())
    lossy = [row for row in rows if "compression" in row]
    assert {row["label"] for row in lossy} == {"int8(b256)", "int4(b64,sr)", "topk(2%)", "topk(1%,exact)"}
    assert all(row["wrong"] == 0 for row in rows)
    big = {row["label"]: row["wire_bytes"] for row in lossy if row["size_bytes"] == 262144}
    plain = {row["plain_bytes"] for row in lossy if row["size_bytes"] == 262144}
    # What a rank sends of a plain bfloat16 all-reduce's bytes: 1/2 (int8), 1/4
    # (int4), each plus a float32 scale per block; top-k's k entries, 6 bytes each.
    assert plain == {pycomm.compression.plain_allreduce_bytes(131072, 2, 3)}
    plain = plain.pop()
    assert plain / 2 < big["int8(b256)"] < plain / 1.9 and plain / 4 < big["int4(b64,sr)"] < plain / 3
    assert big["topk(1%,exact)"] < big["topk(2%)"] < plain / 4
    # The summary never calls a lossy row the best algorithm.
    best = [line for line in r.stdout.splitlines() if ": best " in line]
    assert best and not any("int" in line or "topk" in line for line in best)
    assert sum(": compressed " in line for line in r.stdout.splitlines()) == 2


def test_compressed_check_catches_a_wrong_result(monkeypatch):
    """The bound a compressed row is checked against fails a result off by
    one scale in one element (one rank, no peers needed)."""
    import torch.distributed as dist

    from pycomm.bench.compressed import CompressedCase

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(29500 + os.getpid() % 1000))
    dist.init_process_group("gloo", rank=0, world_size=1)
    comm = pycomm.Communicator()
    try:
        for codec in (pycomm.Int8(), pycomm.Int4(block=64), pycomm.TopK(ratio=0.05)):
            case = CompressedCase(comm, codec, 1 << 14, torch.float32, "sum")
            assert case.wrong() == 0
            real_call = case._checked_call

            def spoiled(**kwargs):
                real_call(**kwargs)
                case.out[100] += 1.0 if pycomm.compression.is_quantizer(codec) else 1e-3
            case._checked_call = spoiled
            assert case.wrong() == 1, codec
    finally:
        comm.close()
        dist.destroy_process_group()


@pytest.mark.parametrize("args,words", [
    (["-c", "all_gather", "--compression", "int8"], "-c all_reduce only"),
    (["--compression", "int8", "-o", "max"], "-o sum or -o avg"),
    (["--compression", "int8", "-d", "int32"], "--compression takes float"),
    (["--compression", "int3"], "unknown codec"),
    (["--compression", "topk:0.1:stochastic"], "bad codec"),
    (["--compression", "int8:0"], "bad codec"),
    (["-b", "64M", "-e", "1K"], "-b must not exceed -e"),
    (["-n", "0"], "-n must be at least 1"),
    (["-w", "-1"], "-w must not be negative"),
    (["--timeout", "0"], "--timeout must be a number of seconds above 0"),
    (["-a", "ring,butterfly"], "unknown algorithm"),
    (["-d", "complex64"], "unknown dtype"),
    (["-b", "12Q"], "bad size"),
    (["--deepspeed", "-o", "max"], "op sum on float32, bfloat16 or float16 only"),
    (["--deepspeed", "-c", "all_reduce,broadcast"], "op sum on float32, bfloat16 or float16 only"),
    (["-c", "all_reduce,allgather"], "unknown collective 'allgather'"),
    (["-c", "all_reduce,all_reduce"], "names each collective once"),
    (["-c", ","], "names each collective once"),
    (["-c", "all", "--plot", "x.png"], "--plot draws one collective"),
    (["-c", "all", "--compression", "int8"], "-c all_reduce only"),
])
def test_bad_options(args, words, capsys):
    """Refused before any rank starts; in this process (a CLI run per case
    cost seconds of imports each; the next test runs the command itself)."""
    from pycomm.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(args)
    assert e.value.code not in (0, None)
    captured = capsys.readouterr()
    assert words in captured.out + captured.err + str(e.value.code)


def test_a_bad_option_fails_the_command():
    r = bench("-b", "64M", "-e", "1K")
    assert r.returncode != 0 and "-b must not exceed -e" in r.stderr


BIND_SCRIPT = r"""
import os, threading, time, json
from pycomm import bootstrap
ev = threading.Event()
seen = {}
def early():  # a thread that exists before the binding
    ev.wait()
    seen["early"] = sorted(os.sched_getaffinity(0))
t = threading.Thread(target=early); t.start()
allowed = sorted(os.sched_getaffinity(0))
out = {"allowed": allowed, "too_many": bootstrap.bind_cores(0, len(allowed) + 1),
       "after_refusal": sorted(os.sched_getaffinity(0))}
out["bound"] = bootstrap.bind_cores(len(allowed) - 1, len(allowed))
out["main"] = sorted(os.sched_getaffinity(0))
ev.set(); t.join()
out["early"] = seen["early"]
print(json.dumps(out))
"""


def test_bind_cores_binds_every_thread_to_its_share():
    """In a fresh process (binding would pin the test runner): the last local
    rank of as many as there are CPUs gets the last CPU, in every thread,
    including one started before; more ranks than CPUs leave it unbound."""
    r = subprocess.run([sys.executable, "-c", BIND_SCRIPT], capture_output=True, text=True, env=ENV, timeout=120)
    assert r.returncode == 0, r.stderr
    import json

    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["too_many"] is None and out["after_refusal"] == out["allowed"]
    assert out["bound"] == out["main"] == out["early"] == [out["allowed"][-1]], out


def test_gpu_nccl_script_checks_itself_on_cpu():
    """benchmarks/gpu/nccl_one_gpu.py runs on a GPU machine only when one is
    lent (its ``nccl`` stage): its checks run here on CPU tensors over Gloo
    (--cpu), so a broken script cannot waste a GPU lease; every line passes."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(root, "benchmarks", "gpu", "nccl_one_gpu.py"), "--cpu"],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [line for line in r.stdout.splitlines() if line.startswith(("group path", "hook"))]
    assert len(lines) == 11 and not any("FAILED" in line or "DIFFER" in line for line in lines), r.stdout


def _gpu_script(name: str):
    """benchmarks/gpu/<name>.py as a module (its folder on the path while it
    loads: the scripts import their shared timing module)."""
    import importlib.util

    gpu = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "gpu")
    sys.path.insert(0, gpu)
    try:
        spec = importlib.util.spec_from_file_location(f"gpu_{name}", os.path.join(gpu, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(gpu)
    return mod


def test_overlap_trace_analysis_on_a_synthetic_trace():
    """The GPU overlap report's arithmetic (benchmarks/gpu/overlap_trace.py):
    pycomm's kernels on stream 20 over 2 steps of 100 us, one half-covered by a
    backward kernel on stream 7, one not; a kernel of its own stream never
    counts as overlap."""
    mod = _gpu_script("overlap_trace")
    k = lambda name, stream, ts, dur: {"cat": "kernel", "name": name, "ts": ts, "dur": dur,  # noqa: E731
                                      "args": {"stream": stream}}
    trace = {"traceEvents": [
        k("void at::native::gemm_kernel(...)", 7, 0, 60),
        k("void pycomm::kernels::cuda_detail::quantize_kernel<float>(...)", 20, 40, 40),  # 20 of 40 overlapped
        k("void at::native::add_kernel(...)", 20, 90, 10),  # same stream as ours: no overlap
        k("void pycomm::kernels::cuda_detail::dequantize_kernel<float>(...)", 20, 100, 20),
        k("void at::native::relu_kernel(...)", 7, 150, 50),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 500},
    ]}
    res = mod.analyse(trace, steps=2)
    assert res["step_ms"] == pytest.approx(0.1)
    assert res["pycomm_kernel_ms_per_step"] == pytest.approx(0.03)
    assert res["pycomm_share"] == pytest.approx(60 / 200)
    assert res["overlapped_share"] == pytest.approx(20 / 60)
    assert res["pycomm_streams"] == [20] and res["other_streams"] == [7, 20]
    assert mod.analyse({"traceEvents": []}, 1) == {"error": "no kernels in the trace"}


def test_gpu_allreduce_traffic_model():
    """The bytes benchmarks/gpu/allreduce.py's %copy counts per call, against
    closed forms: two-shot 4 (5n + n/w) per rank; int8 / int4 (no error
    feedback) 2 x 4n + (3w + 1) slots per rank, a slot being a shard of
    ceil(n / w) rounded up to whole blocks, its codes (bits / 8 a value) and
    one float32 scale a block, padded to 8 bytes; ring from its program,
    more than two-shot's reduce and gather alone."""
    import pycomm

    mod = _gpu_script("allreduce")
    core = pycomm.load_core()
    for w in (2, 3, 4):
        for n in (1 << 20, 1000003):
            assert mod.traffic(core, "two_shot", w, n, 0) == w * 4 * (5 * n + n // w)
            assert mod.traffic(core, "two_shot_db", w, n, 0) == mod.traffic(core, "two_shot", w, n, 0)
            for name, bits, block in (("int8", 8, pycomm.Int8().block), ("int4", 4, pycomm.Int4().block),
                                      ("int8_split", 8, pycomm.Int8().block),  # the same bytes, a kernel per step
                                      ("int8_g72", 8, pycomm.Int8().block)):  # and on another grid
                shard = -(-(-(-n // w)) // block) * block
                slot = -(-(shard * bits // 8 + 4 * (-(-shard // block))) // 8) * 8
                assert mod.traffic(core, name, w, n, 0) == w * (8 * n + (3 * w + 1) * slot), (name, w, n)
            assert mod.traffic(core, "ring", w, n, 1 << 20) > w * 4 * 2 * n
    assert mod.traffic(core, "gloo", 2, 1 << 20, 0) == 0


def test_gpu_kernel_benchmark_checks_itself_on_cpu(tmp_path, capsys):
    """benchmarks/gpu/kernels.py (the GPU kernels against the copy bandwidth,
    float32 and bfloat16, and top-k at two sizes) runs on a GPU machine only
    when one is lent: here it runs on CPU tensors at a small size, so a broken
    script cannot waste a lease, and every row's check against the CPU
    kernels counts nothing wrong."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "kernels.py", "--device", "cpu", "--elems", "65536", "--repeats", "2"],
                       capture_output=True, text=True, env=ENV, timeout=300,
                       cwd=os.path.join(root, "benchmarks", "gpu"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line for line in r.stdout.splitlines() if "|" in line and not line.lstrip().startswith("kernel")]
    kernels = [line for line in rows if "(float32)" in line or "(bfloat16)" in line]
    assert len(kernels) == 10 and all(line.rsplit("|", 1)[1].strip() == "0" for line in kernels), r.stdout
    topk = [line for line in r.stdout.splitlines() if line.startswith("top-k")]
    assert len(topk) == 2 and all(line.endswith("#wrong 0") for line in topk), r.stdout
    assert "1024-column rows" in topk[1], r.stdout  # a gradient's structure
    # The script's other modes in this process (the launch above checked how
    # it starts). --offset: the same rows on tensors one element off, checked
    # the same way.
    kernels_py = _gpu_script("kernels")
    capsys.readouterr()
    kernels_py.main(["--device", "cpu", "--elems", "65536", "--repeats", "1", "--offset"])
    off = capsys.readouterr().out
    rows_off = [line for line in off.splitlines() if ", offset)" in line]
    assert len(rows_off) == 10 and all(line.rsplit("|", 1)[1].strip() == "0" for line in rows_off), off
    # --summarize: min / median / max over launches' logs, one row per kernel
    # and top-k speed-up (here the same log twice, and one with a row moved).
    log = str(tmp_path / "kernels_1.log")
    with open(log, "w") as f:
        # A GPU launch's last line (the fused IPC kernel), as kernels.py prints it there.
        f.write(r.stdout + "fused IPC int8 all-reduce, 1 rank, 396 blocks at most: 0.500 ms, 1610 GB/s, "
                           "42% of copy | #wrong 0\n")
    first = kernels[0]
    share = int(first.rsplit("|", 2)[1].strip().rstrip("%"))
    moved = log + ".2"
    with open(moved, "w") as f:
        f.write(r.stdout.replace(first, first.replace(f"{share:6d}%", f"{share + 7:6d}%")))
    kernels_py.main(["--summarize", log, log, moved])
    out = capsys.readouterr().out
    summary = out.splitlines()
    assert len(summary) == 1 + 10 + 3 + 1, out
    name = first.split("|")[0].strip()
    row = next(line for line in summary if line.strip().startswith(name))
    assert f"{share}% / {share}% / {share + 7}%" in row and "|        3 |" in row, row
    fused = next(line for line in summary if line.strip().startswith("fused IPC"))
    assert "42% / 42% / 42%" in fused and fused.rstrip().endswith("| -"), fused


def test_ddp_hooks_summarize_launches(tmp_path):
    """benchmarks/ddp_hooks.py summarize: per rate, each config's step time
    min / median / max over the launches, and the median of the speed-ups
    over torch's bf16 hook taken within each launch."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("ddp_hooks", os.path.join(root, "benchmarks", "ddp_hooks.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    steps = {"torch-bf16": [100.0, 120.0, 90.0], "int8": [50.0, 80.0, 30.0]}
    paths = []
    for launch in range(3):
        rows = [dict(config=c, step_ms=steps[c][launch], final_loss=0.5 + launch) for c in steps]
        path = tmp_path / f"nccl_ddp_1gbit_{launch + 1}.json"
        path.write_text(json.dumps({"mode": "e2e", "rows": rows}))
        paths.append(str(path))
    out = mod.summarize(paths)
    assert "### 1gbit: 3 launches" in out
    # int8: 30 / 50 / 80 ms; speed-ups 2.0, 1.5, 3.0 -> median 2.00x; losses 0.5, 1.5, 2.5 -> 1.5
    assert "| int8 | 30.0 / 50.0 / 80.0 | 2.00x | 1.5000 |" in out, out
    assert "| torch-bf16 | 90.0 / 100.0 / 120.0 | 1.00x | 1.5000 |" in out, out


def test_launch_tools_refuse_rows_of_several_collectives(monkeypatch, tmp_path):
    """benchmarks/ab_launches.py and launch_spread.py compare rows by size and
    algorithm, which several collectives share: a sweep of more than one
    (-c a,b) is refused, not mixed."""
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
    monkeypatch.syspath_prepend(bench_dir)
    import ab_launches

    def fake_run(cmd, **kwargs):
        out = cmd[cmd.index("--json") + 1]
        rows = [dict(collective=c, size_bytes=1024, label="ring", backend="pycomm", time_us=1.0)
                for c in written]
        with open(out, "w") as f:
            json.dump(rows, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(ab_launches.subprocess, "run", fake_run)
    written = ["all_reduce"]
    assert [r["collective"] for r in ab_launches.launch(str(tmp_path), ["-c", "all_reduce"])] == ["all_reduce"]
    written = ["all_reduce", "broadcast"]
    with pytest.raises(SystemExit, match="one collective"):
        ab_launches.launch(str(tmp_path), ["-c", "all_reduce,broadcast"])
