"""Schedules, executed symbolically: no processes, no memory, just who sends
which chunk when. Every rank's chunk values are multisets of contributing
ranks; a correct all-reduce ends with every rank holding every rank once.

Also checks the executor's contract (csrc/algorithms/schedule.h): a receive
names the step its data was sent at, never a later one; sends come before
receives; a chunk enters one mailbox region at most once per round.
"""
from collections import Counter

import pytest
import torch  # noqa: F401

import pycomm

C = pycomm.load_core()
# Ids as the core publishes them (never restated here).
RING, TREE, ONESHOT, TWOSHOT = (C.algorithm_names.index(n)
                                for n in ("ring", "tree", "direct(one-shot)", "direct(two-shot)"))
ALL_REDUCE, REDUCE_SCATTER, ALL_GATHER, BROADCAST, ALL_TO_ALL = (
    C.collectives.index(n) for n in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "all_to_all"))
SEND, RECV_REDUCE, RECV_COPY = (C.op_kinds[k] for k in ("send", "recv_reduce", "recv_copy"))
ALL_PEERS = C.all_peers

CASES = [
    (RING, ALL_REDUCE), (TREE, ALL_REDUCE), (ONESHOT, ALL_REDUCE), (TWOSHOT, ALL_REDUCE),
    (RING, REDUCE_SCATTER), (TWOSHOT, REDUCE_SCATTER),
    (RING, ALL_GATHER), (TWOSHOT, ALL_GATHER),
    (RING, BROADCAST), (TREE, BROADCAST), (ONESHOT, BROADCAST),
]


def has_input(coll, chunk, rank):
    return coll != ALL_GATHER or chunk == rank


def simulate(algo, coll, world, root):
    chunks, steps = C.schedule_shape(algo, coll, world, root)
    value = [[Counter({r: 1}) if has_input(coll, c, r) else None for c in range(chunks)] for r in range(world)]
    if coll == BROADCAST:
        value = [[Counter({r: 1}) for _ in range(chunks)] for r in range(world)]
    sent = {}  # (sender, step, phase, chunk) -> (value, receivers)
    written = set()
    for step in range(steps):
        ops = {r: C.schedule_ops(algo, coll, r, world, root, step) for r in range(world)}
        for r in range(world):
            kinds = [k for k, *_ in ops[r]]
            assert kinds == sorted(kinds, key=lambda k: k != SEND), f"rank {r} step {step}: sends must come first"
            for kind, phase, peer, chunk, _ in ops[r]:
                if kind != SEND:
                    continue
                assert value[r][chunk] is not None, f"rank {r} sends chunk {chunk} it does not have"
                assert peer == ALL_PEERS or 0 <= peer < world and peer != r
                key = (r, phase, chunk)
                prior = sent.get((r, step, phase, chunk))
                if prior is None:
                    # A chunk may be sent to several peers in one step, but never
                    # re-written into a region within the round.
                    assert key not in written, f"rank {r} rewrites chunk {chunk} in phase {phase}"
                    written.add(key)
                    sent[(r, step, phase, chunk)] = Counter(value[r][chunk])
        for r in range(world):
            recvs = [op for op in ops[r] if op[0] != SEND]
            i = 0
            while i < len(recvs):
                chunk = recvs[i][3]
                group = []
                while i < len(recvs) and recvs[i][3] == chunk:
                    group.append(recvs[i])
                    i += 1
                acc = Counter(value[r][chunk]) if group[0][0] == RECV_REDUCE else Counter()
                for j, (kind, phase, peer, c, sent_step) in enumerate(group):
                    assert j == 0 or kind == RECV_REDUCE, "copies only open a group"
                    if peer == r:
                        acc.update(value[r][c])
                        continue
                    assert sent_step <= step, f"rank {r} waits for a send from a later step"
                    msg = sent.get((peer, sent_step, phase, c))
                    assert msg is not None, (f"rank {r} step {step} expects chunk {c} phase {phase} "
                                             f"from rank {peer} at step {sent_step}, never sent")
                    acc.update(msg)
                value[r][chunk] = acc
    return value, chunks


@pytest.mark.parametrize("algo,coll", CASES)
@pytest.mark.parametrize("world", list(range(1, 13)))
def test_schedule_delivers(algo, coll, world):
    roots = sorted({0, world - 1, world // 2}) if coll == BROADCAST else [0]
    everyone = Counter(range(world))
    for root in roots:
        value, chunks = simulate(algo, coll, world, root)
        for r in range(world):
            for c in range(chunks):
                got = value[r][c]
                if coll == ALL_REDUCE:
                    assert got == everyone, (r, c, got)
                elif coll == REDUCE_SCATTER and c == r:
                    assert got == everyone, (r, c, got)
                elif coll == ALL_GATHER:
                    assert got is not None and set(got) == {c}, (r, c, got)
                elif coll == BROADCAST:
                    assert got == Counter({root: 1}) or (r == root and got == Counter({root: 1})), (r, c, got)


def test_tree_is_double_binary():
    """Most ranks are leaves in one tree and inner nodes in the other."""
    for world in (7, 8, 15, 16):
        ops0 = [C.schedule_ops(TREE, ALL_REDUCE, r, world, 0, 0) for r in range(world)]
        # At step 0 only leaves send partial sums up: chunk 0 (tree 0) or chunk P (tree 1).
        p = C.schedule_shape(TREE, ALL_REDUCE, world, 0)[0] // 2
        leaf0 = {r for r in range(world) if any(k == SEND and ch == 0 for k, _, _, ch, _ in ops0[r])}
        leaf1 = {r for r in range(world) if any(k == SEND and ch == p for k, _, _, ch, _ in ops0[r])}
        assert len(leaf0 & leaf1) <= 1, (world, leaf0, leaf1)


def test_tree_latency_is_logarithmic():
    _, ring_steps = C.schedule_shape(RING, ALL_REDUCE, 64, 0)
    _, tree_steps = C.schedule_shape(TREE, ALL_REDUCE, 64, 0)
    assert ring_steps == 2 * 63
    assert tree_steps < 20


def test_tuner_is_deterministic_and_supports():
    auto = pycomm.ALGORITHMS["auto"]
    assert C.tune(auto, ALL_REDUCE, 1024, 2) == ONESHOT
    assert C.tune(auto, ALL_REDUCE, 64 << 20, 2) in (RING, TREE, TWOSHOT)
    assert C.tune(auto, REDUCE_SCATTER, 1 << 20, 4) in (RING, TWOSHOT)
    assert not C.algorithm_supports(TREE, ALL_GATHER)
    assert C.algorithm_supports(TREE, BROADCAST)



@pytest.mark.parametrize("world", list(range(1, 13)))
def test_all_to_all_schedule(world):
    """Rank r sends chunk p (its block for p) to p; p receives chunk r from r, reading r's slot for p."""
    chunks, steps = C.schedule_shape(TWOSHOT, ALL_TO_ALL, world, 0)
    assert chunks == world and steps == (1 if world > 1 else 0)
    got = {(r, r): (r, r) for r in range(world)}  # own block stays (a local copy)
    for step in range(steps):
        ops = {r: C.schedule_ops(TWOSHOT, ALL_TO_ALL, r, world, 0, step) for r in range(world)}
        sent = {(r, chunk): (r, chunk) for r in range(world) for kind, _, peer, chunk, _ in ops[r]
                if kind == SEND and peer == chunk}
        for p in range(world):
            for kind, _, peer, chunk, sent_step in ops[p]:
                if kind == SEND:
                    continue
                assert kind == RECV_COPY and chunk == peer and sent_step == step
                got[(p, chunk)] = sent[(peer, p)]  # the peer's block addressed to p
    assert got == {(p, r): (r, p) for p in range(world) for r in range(world)}
    assert C.algorithm_supports(TWOSHOT, ALL_TO_ALL) and not C.algorithm_supports(RING, ALL_TO_ALL)


def _check_program(algo, coll, world, n, g, round_bytes, seed=0):
    """Every rank's program run on the CPU against the closed form:
    integer-valued float64 sums are exact."""
    root = world // 2
    per_rank = n * world if coll == REDUCE_SCATTER else n
    xs = [torch.randint(-1000, 1000, (per_rank,), generator=g).double() for _ in range(world)]
    if coll == ALL_REDUCE:
        exp = [sum(xs)] * world
    elif coll == REDUCE_SCATTER:
        total = sum(xs)
        exp = [total[r * n:(r + 1) * n] for r in range(world)]
    elif coll == ALL_GATHER:
        exp = [torch.cat(xs)] * world
    else:
        exp = [xs[root]] * world
    outs = [torch.full_like(e, 7) for e in exp]
    C.simulate_program(algo, coll, root, C.reduce_ops["sum"], xs, outs, round_bytes, seed=seed)
    for r in range(world):
        assert torch.equal(outs[r], exp[r]), \
            f"{n} elements, seed {seed}: rank {r} differs in {(outs[r] != exp[r]).sum()}"


@pytest.mark.parametrize("algo,coll", CASES)
@pytest.mark.parametrize("world", [1, 2, 3, 5, 8])
def test_device_program_delivers(algo, coll, world):
    """The program the CUDA executor runs (every rank's, run on the CPU),
    against the closed form. 70001 elements of 8 bytes in 64 KiB rounds:
    many rounds, so every mailbox half is reused and the round-done waits
    matter."""
    g = torch.Generator().manual_seed(world * 100 + algo * 10 + coll)
    for n in (0, 1, 7, 1021, 70001):
        _check_program(algo, coll, world, n, g, 64 * 1024)


@pytest.mark.parametrize("algo,coll", CASES)
@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_device_program_delivers_under_any_interleaving(algo, coll, world):
    """The same programs with the ranks interleaved at random (a random rank
    runs 1 to 8 ops at a time, 16 seeds): any rank may run ahead of any other,
    as the GPU's blocks may, and a slot refilled before its reader got to it
    would show in the output. Small rounds (1 KiB) make the mailbox halves
    turn over often."""
    g = torch.Generator().manual_seed(world * 1000 + algo * 10 + coll)
    for seed in range(1, 17):
        for n in (5, 1021, 4099):
            _check_program(algo, coll, world, n, g, 1024, seed=seed)


def test_device_program_refuses_what_it_cannot_run():
    xs = [torch.zeros(4) for _ in range(2)]
    with pytest.raises(Exception, match="concrete schedule"):
        C.simulate_program(C.algorithms["direct"], ALL_REDUCE, 0, C.reduce_ops["sum"], xs, [torch.zeros(4) for _ in range(2)], 65536)
    with pytest.raises(Exception, match="concrete schedule"):
        C.simulate_program(TREE, ALL_GATHER, 0, C.reduce_ops["sum"], xs, [torch.zeros(8) for _ in range(2)], 65536)


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_program_traffic_of_the_ring(world):
    """Bytes the ring's programs read and write, against its closed form per
    rank: the first reduce-scatter step copies its chunk out (2c) and reduces
    two sources into the staging (3c), later ones reduce (3c), the last also
    writes the output (4c); all-gather steps copy a chunk in and forward it
    (3c), the last only copies (2c): (8 + 6 (world - 2)) c, c = n / world."""
    n, es = 64 * 1024 * world, 4
    got = C.program_traffic(RING, ALL_REDUCE, world, 0, es, n, 64 * n)  # one round
    assert got == world * (8 + 6 * (world - 2)) * (n // world) * es
    assert C.program_traffic(RING, ALL_REDUCE, 1, 0, es, n, 64 * n) == 0
