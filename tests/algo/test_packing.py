import random

import pytest

from areal_hpc.algo.packing import pack_sequences


def _check(lengths, budget, mbs):
    flat = sorted(i for mb in mbs for i in mb)
    assert flat == list(range(len(lengths)))
    for mb in mbs:
        assert len(mb) == 1 or sum(lengths[i] for i in mb) <= budget


def test_fits_in_one():
    assert pack_sequences([3, 4, 5], 100) == [[0, 1, 2]]


def test_minimal_number_of_balanced_micro_batches():
    lengths = [100, 200, 300, 150, 250]  # total 1000, budget 500 -> 2 bins of 500
    mbs = pack_sequences(lengths, 500)
    _check(lengths, 500, mbs)
    assert len(mbs) == 2
    assert sorted(sum(lengths[i] for i in mb) for mb in mbs) == [500, 500]


def test_balanced_loads():
    mbs = pack_sequences([50] * 10, 200)  # 500 tokens, 3 bins: 4/3/3 sequences
    assert sorted(len(mb) for mb in mbs) == [3, 3, 4]


def test_oversized_sequence_gets_its_own_micro_batch():
    lengths = [10, 700, 20, 30]
    mbs = pack_sequences(lengths, 64)
    _check(lengths, 64, mbs)
    assert [1] in mbs
    assert len(mbs) == 2


def test_adds_bins_when_greedy_does_not_fit():
    # total 18 <= 2*10, but 6,6,6 cannot go into two bins of 10.
    mbs = pack_sequences([6, 6, 6], 10)
    assert len(mbs) == 3


def test_deterministic_and_valid_on_random_inputs():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(50, 1000)
        mbs = pack_sequences(lengths, budget)
        _check(lengths, budget, mbs)
        assert mbs == pack_sequences(list(lengths), budget)


def test_edge_cases():
    assert pack_sequences([], 10) == []
    with pytest.raises(ValueError):
        pack_sequences([1], 0)


def test_ffd_allocate_by_hand():
    from areal_hpc.algo.packing import ffd_allocate
    # decreasing: 7(i1) → g0; 5(i3) → g1; 4(i0) → g1 (9); 3(i2) → g0 (10); 1(i4) → g1 (10)
    assert ffd_allocate([4, 7, 3, 5, 1], capacity=10) == [[0, 3, 4], [1, 2]]
    # min_groups=4: from {1,2} {0,3,4}, move 4 (smallest of the most populous), then 2 (of {1,2},
    # the first of the two-element groups)
    assert ffd_allocate([4, 7, 3, 5, 1], capacity=10, min_groups=4) == [[0, 3], [1], [2], [4]]
    assert ffd_allocate([], capacity=5, min_groups=0) == []


def test_ffd_allocate_errors_name_the_problem():
    from areal_hpc.algo.packing import ffd_allocate
    with pytest.raises(ValueError, match="sequence 2 has 11 tokens, more than the capacity of 10"):
        ffd_allocate([1, 2, 11], capacity=10)
    with pytest.raises(ValueError, match="2 sequences cannot fill min_groups=3"):
        ffd_allocate([1, 2], capacity=10, min_groups=3)


@pytest.mark.parametrize("seed", range(20))
def test_ffd_allocate_properties_on_long_tailed_lengths(seed):
    import random

    from areal_hpc.algo.packing import ffd_allocate
    rng = random.Random(seed)
    n = rng.randint(1, 200)
    lengths = [min(int(rng.paretovariate(1.2) * 20), 1024) for _ in range(n)]
    min_groups = rng.randint(1, n)
    groups = ffd_allocate(lengths, capacity=1024, min_groups=min_groups)
    flat = sorted(i for g in groups for i in g)
    assert flat == list(range(n))                               # every index exactly once
    assert all(sum(lengths[i] for i in g) <= 1024 for g in groups)
    assert len(groups) >= min_groups and all(groups)
