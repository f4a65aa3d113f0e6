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
