"""The collective matrix: world sizes 1-8 (8 ranks on 2 cores too), every
algorithm, dtype and reduce op, counts 0, 1, primes and sizes that do not
divide evenly into chunks or rounds; results checked against a float64
reference and required to be bitwise identical on every rank."""
import pytest

from collective_cases import matrix_failures, sweep

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
