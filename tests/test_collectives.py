"""The collective matrix: world sizes 1-8 (8 ranks on 2 cores too), every
algorithm, dtype and reduce op, counts 0, 1, primes and sizes that do not
divide evenly into chunks or rounds; results checked against a float64
reference and required to be bitwise identical on every rank."""
import pytest

from collective_cases import matrix_failures, program_sweep, sweep

ALGOS = {
    "all_reduce": ["ring", "tree", "direct", "auto"],
    "reduce_scatter": ["ring", "direct", "auto"],
    "all_gather": ["ring", "direct", "auto"],
    "broadcast": ["ring", "tree", "direct", "auto"],
}


@pytest.mark.parametrize("coll", list(ALGOS))
@pytest.mark.parametrize("world", list(range(1, 9)))
def test_collective_matrix(pool8, coll, world):
    per_rank = pool8.run(sweep, world, pool8.new_name(), coll, ALGOS[coll], world=world)
    failures = matrix_failures(per_rank)
    assert not failures, f"{len(failures)} failing cases of {len(per_rank[0])}:\n" + "\n".join(failures[:20])


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
def test_device_program_matches_the_shared_memory_executor(pool8, world):
    """The program the CUDA executor of schedules runs (ring, tree, direct),
    run on the CPU, gives the communicator's all-reduce bits: every dtype,
    sum/avg/max/min, counts across chunk and round boundaries."""
    results = pool8.run(program_sweep, world, pool8.new_name(), world=world)[0]
    failures = [f"{key}: {err}" for key, err in results if err]
    assert len(results) > 100
    assert not failures, f"{len(failures)} of {len(results)} cases differ:\n" + "\n".join(failures[:20])
